"""Per-rank memory accounting of model state, counted from tensor storage (not estimated)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; a
    DTensor counts the shard this rank holds)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.ndim > 0
    ]


def memory_report(
    module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes of parameters, gradients and (given the optimizer) optimizer state on this rank."""
    params = list(module.parameters())
    report = {
        "parameters": storage_bytes(params),
        "gradients": storage_bytes(p.grad for p in params),
    }
    if optimizer is not None:
        report["optimizer_state"] = storage_bytes(optimizer_state_tensors(optimizer))
    report["total"] = sum(report.values())
    return report
