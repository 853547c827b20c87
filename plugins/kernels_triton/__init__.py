"""The Triton kernel provider: fused norms, activations, RoPE, cross-entropy, attention, AdamW.

Answers `plait_kernel` as provider `"triton"`:

- on CUDA, when triton is importable, for any request (`provider` `None` or `"triton"`);
- on CPU only under the Triton interpreter (`TRITON_INTERPRET=1`) and only when `"triton"` is
  asked for by name (`kernels.prefer = ["triton", …]` or `kernels.overrides`), so CPU training
  keeps the torch reference unless told otherwise. The interpreter is for testing the kernels'
  correctness, not for speed.

triton is imported lazily, when a kernel is first handed out: registering this plugin costs
nothing on machines without it, and the interpreter switch is read when the kernels are built.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

from plait.core.hookspecs import hookimpl
from plait.core.kernels import KERNEL_OPS
from plait.core.records import KernelRecord

PROVIDER = "triton"

# op name -> (module inside this package, function), imported on first request.
# The row, point-wise and attention ops come through `custom_ops`: the kernels'
# autograd.Functions when eager, one custom op each under torch.compile.
_IMPLEMENTATIONS: dict[str, tuple[str, str]] = {
    "rms_norm": ("custom_ops", "rms_norm"),
    "layer_norm": ("custom_ops", "layer_norm"),
    "swiglu": ("custom_ops", "swiglu"),
    "bias_gelu": ("custom_ops", "bias_gelu"),
    "rope": ("custom_ops", "rope"),
    "softmax_cross_entropy": ("custom_ops", "softmax_cross_entropy"),
    "attention": ("custom_ops", "attention"),
    "adamw_step": ("adamw", "adamw_step"),
    "grouped_mm": ("grouped_gemm", "grouped_mm"),
}
_DESCRIPTIONS: dict[str, str] = {
    "rms_norm": "fused RMSNorm, forward and backward (persistent weight-grad reduction)",
    "layer_norm": "fused LayerNorm, forward and backward (persistent weight/bias-grad reduction)",
    "swiglu": "fused silu(gate)·up, forward and backward",
    "bias_gelu": "fused bias + tanh-GELU, forward and backward",
    "rope": "rotary embedding (rotate_half), forward and inverse-rotation backward",
    "softmax_cross_entropy": "cross-entropy chunked over the vocabulary (online log-sum-exp), "
    "gradient written by the backward",
    "attention": "FlashAttention-2 style causal attention with GQA and document masking "
    "(walks only each document's tiles), forward and backward",
    "adamw_step": "fused AdamW update, fp32 math, in place",
    "grouped_mm": "grouped GEMM over variable-sized row groups (experts), forward and backward",
}
SUPPORTED_DTYPES = frozenset({"float32", "float16", "bfloat16"})

_missing = set(KERNEL_OPS) - set(_IMPLEMENTATIONS)
if _missing:  # pragma: no cover - guards against adding an op to the core without a kernel
    raise ImportError(f"kernels_triton has no kernel for {sorted(_missing)}")


def triton_available() -> bool:
    """Whether triton can be imported here (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    from plait.plugins.kernels_triton.launch import interpreting

    return interpreting()


def load_kernel(name: str) -> Callable[..., Any]:
    """Import and return the Triton implementation of op `name`, tagged with its provider."""
    module_name, function_name = _IMPLEMENTATIONS[name]
    module = importlib.import_module(f"{__name__}.{module_name}")
    kernel = getattr(module, function_name)
    kernel.plait_provider = PROVIDER
    return kernel


def device_types() -> tuple[str, ...]:
    """The device types this provider can serve in this process."""
    if not triton_available():
        return ()
    return ("cuda", "cpu") if interpreter_enabled() else ("cuda",)


@hookimpl
def plait_register_kernels() -> Sequence[KernelRecord]:
    devices = device_types()
    if not devices:
        return []
    return [
        KernelRecord(
            op=op,
            provider=PROVIDER,
            device_types=devices,
            description=_DESCRIPTIONS[op],
            # The ops served through `custom_ops` are one node each; the compiler cannot trace
            # the others' launch code (in place, data-shaped).
            compiled_form="custom op" if _IMPLEMENTATIONS[op][0] == "custom_ops" else "graph break",
        )
        for op in KERNEL_OPS
    ]


# NOTE: not keyword-only: pluggy passes hook arguments without defaults positionally.
@hookimpl
def plait_kernel(
    name: str, device: str, dtype: str, provider: str | None
) -> Callable[..., Any] | None:
    if provider not in (None, PROVIDER) or name not in _IMPLEMENTATIONS:
        return None
    if dtype not in SUPPORTED_DTYPES or not triton_available():
        return None
    if device == "cuda" or (device == "cpu" and provider == PROVIDER and interpreter_enabled()):
        return load_kernel(name)
    return None
