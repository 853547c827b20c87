"""The `compiled` kernel provider: `torch.compile` of the torch reference of each op, served by
the reference plugin under a second provider name.

What a user gets by writing `torch.compile` around plait's reference ops, offered as a provider
so that `kernels.provider = "auto"` weighs it against plait's Triton kernels and torch eager at
the job's shapes (`plait.plugins.kernels_auto`) and keeps whichever is fastest: plait is then
never slower than the compiler on an op, by choice if not by kernel.

Answers only when asked for by name — `"compiled"` in `kernels.prefer` or
`kernels.overrides`, or by the measurement of `auto` — never as a default: a first call compiles
(seconds on a GPU, more on a CPU), which nobody should pay without asking. Registered for CPU
and CUDA, for the ops whose reference compiles as one graph:

- not `adamw_step`: it updates the optimizer state in place (torch's own fused AdamW is the
  compiled-speed peer there, and `auto` never times in-place ops);
- not `grouped_mm`: its group sizes are data, so every new routing would recompile.

Each op compiles once per process (`torch.compile` then specialises per shape and dtype, and
marks a dimension dynamic the second time it changes). The compiled function runs the same
arithmetic as the reference, so its results match it to rounding (tested on CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from plait.core.records import KernelRecord
from plait.plugins.kernels_torch.ops import OPS

PROVIDER = "compiled"
COMPILED_OPS: tuple[str, ...] = (
    "rms_norm",
    "layer_norm",
    "swiglu",
    "bias_gelu",
    "rope",
    "softmax_cross_entropy",
    "attention",
)
SUPPORTED_DTYPES = frozenset({"float32", "float16", "bfloat16"})


@functools.cache
def compiled_op(name: str) -> Callable[..., Any]:
    """The reference of op `name` under `torch.compile`, tagged with this provider."""
    compiled = torch.compile(OPS[name])

    @functools.wraps(OPS[name])
    def run(*args: Any, **kwargs: Any) -> Any:
        return compiled(*args, **kwargs)

    run.plait_provider = PROVIDER  # type: ignore[attr-defined]
    return run


def compiled_records() -> list[KernelRecord]:
    return [
        KernelRecord(
            op=op,
            provider=PROVIDER,
            device_types=("cpu", "cuda"),
            description=f"torch.compile of the reference {op} (asked by name or by auto)",
            compiled_form="traced",  # inside a compiled block, its reference is inlined
        )
        for op in COMPILED_OPS
    ]


def compiled_kernel(name: str, device: str, dtype: str) -> Callable[..., Any] | None:
    """The compiled op for a request naming this provider; None where it does not serve."""
    if name not in COMPILED_OPS or dtype not in SUPPORTED_DTYPES or device not in ("cpu", "cuda"):
        return None
    return compiled_op(name)
