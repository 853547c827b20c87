"""Launch-shape helpers shared by the Triton kernels: block sizes, program counts, precision.

Kept free of `triton.jit` code so that the plugin can ask about the environment without
compiling (or, under `TRITON_INTERPRET=1`, wrapping) any kernel.
"""

from __future__ import annotations

import os

import torch
import triton

# One row of a norm is held in registers; 64 KiB per row is the limit Apex and Liger use before
# a two-pass (looped) kernel would be needed.
MAX_FUSED_ROW_BYTES = 65536

# Under the interpreter, programs run one after another on the host: a few "SMs" are enough to
# exercise the strided loops, and more only cost time.
INTERPRETER_PROGRAMS = 4


def interpreting() -> bool:
    """Whether Triton kernels run on the host interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def row_block_size(n_cols: int, element_size: int) -> int:
    """The power-of-two block that holds one whole row of `n_cols` elements."""
    block = triton.next_power_of_2(n_cols)
    if block * element_size > MAX_FUSED_ROW_BYTES:
        raise ValueError(
            f"row of {n_cols} elements ({block * element_size} bytes padded) is wider than the "
            f"{MAX_FUSED_ROW_BYTES}-byte fused-row limit of the Triton norm kernels; "
            "use the torch provider for this op (kernels.overrides)"
        )
    return block


def default_row_warps(block: int) -> int:
    """Warps for a program that holds one row of `block` elements: enough threads that each
    keeps a few vectors of it in registers (the thresholds Apex's and Liger's norm kernels
    use). The row kernels' tuner starts from it and tries its neighbours."""
    if block < 2048:
        return 4
    if block < 8192:
        return 8
    return 16 if block < 16384 else 32


def backward_programs(n_rows: int, device: torch.device, per_sm: int = 1) -> int:
    """How many persistent programs a row-reduction backward launches: `per_sm` per SM on
    CUDA, never more than there are rows."""
    if device.type == "cuda" and not interpreting():
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = INTERPRETER_PROGRAMS
    return max(1, min(n_rows, sms * per_sm))


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: fp32 follows torch's TF32 switch, as torch matmuls do."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"
