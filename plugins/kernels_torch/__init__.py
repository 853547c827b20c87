"""The torch reference kernel provider: every op in `KERNEL_OPS`, answering `trylast`; and,
under the provider name "compiled", the same ops under `torch.compile` (`compiled.py`).

Faster providers (Triton on CUDA, a vendor library, …) answer first when they can; these plain
PyTorch implementations answer whatever is left, so every op always resolves. They are registered
for CPU and CUDA but answer any device type, since plain torch also runs on the meta device
(shape inference while a model is still unmaterialised) and other accelerators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from plait.core.hookspecs import hookimpl
from plait.core.kernels import KERNEL_OPS
from plait.core.records import KernelRecord
from plait.plugins.kernels_torch.compiled import PROVIDER as COMPILED_PROVIDER
from plait.plugins.kernels_torch.compiled import compiled_kernel, compiled_records
from plait.plugins.kernels_torch.grouped_gemm import grouped_mm
from plait.plugins.kernels_torch.ops import OPS, PROVIDER

__all__ = ["OPS", "PROVIDER", "plait_kernel", "plait_register_kernels"]

# Ops kept in files of their own beside `ops.py` join its table, so `OPS` names every op.
OPS.setdefault("grouped_mm", grouped_mm)

_missing = set(KERNEL_OPS) - set(OPS)
if _missing:  # pragma: no cover - guards against adding an op to the core without a reference
    raise ImportError(f"kernels_torch has no reference implementation for {sorted(_missing)}")


# The reference ops the compiler cannot keep in one graph: grouped_mm reads its group sizes
# (`counts.tolist()`), so a compiled block breaks there, as it does at the routing around it.
_COMPILED_FORMS = {"grouped_mm": "graph break"}


@hookimpl
def plait_register_kernels() -> Sequence[KernelRecord]:
    return [
        KernelRecord(
            op=op,
            provider=PROVIDER,
            device_types=("cpu", "cuda"),
            description=f"plain PyTorch reference {op}",
            compiled_form=_COMPILED_FORMS.get(op, "traced"),
        )
        for op in KERNEL_OPS
    ] + compiled_records()


# NOTE: not keyword-only: pluggy passes hook arguments without defaults positionally, so a
# `*` in an implementation's signature makes every call fail with a TypeError.
@hookimpl(trylast=True)
def plait_kernel(
    name: str, device: str, dtype: str, provider: str | None
) -> Callable[..., Any] | None:
    if provider == COMPILED_PROVIDER:
        return compiled_kernel(name, device, dtype)
    if provider not in (None, PROVIDER):
        return None
    return OPS.get(name)  # plain torch ops are device- and dtype-generic
