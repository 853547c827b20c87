"""The step callbacks that put one replica group's step under torchft's quorum.

Added after the group's own data-parallel runtime, so its `sync_gradients` runs on gradients the
group already reduced (DDP's all-reduce, ZeRO's reduced chunks): it averages the gradients the
optimizer steps on across the live groups, through torchft's `Manager.allreduce`, which records a
failure instead of raising. `skip_step` is the one place a step's commit is decided: torchft's
`should_commit`, a vote of every rank of the group, false if any of them saw an error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from plait.core.sharding import ParallelRuntime


class ReplicaGroupCommit(ParallelRuntime):
    """Average gradients across the quorum; commit the step only when the group agrees."""

    name = "fault_tolerance"

    def __init__(self, *, manager: Any, optimizer: torch.optim.Optimizer) -> None:
        self.manager = manager
        self.optimizer = optimizer
        self.committed: bool | None = None

    def _optimizer_gradients(self) -> list[torch.Tensor]:
        # What the optimizer steps on: whole parameters under DDP, this rank's shard under ZeRO.
        return [
            p.grad
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]

    def sync_gradients(self) -> None:
        self.committed = None
        grads = self._optimizer_gradients()
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        # Sum, then divide by the participants (torchft's AVG): exact with two contributors.
        self.manager.allreduce(flat).wait()
        for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(averaged)

    def skip_step(self) -> bool:
        self.committed = bool(self.manager.should_commit())
        return not self.committed
