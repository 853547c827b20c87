"""The NaN/Inf guard: skip an optimizer step whose gradients are not finite, stop after N in a row.

A runtime `attach_resilience` appends to the engine's runtimes, so its `skip_step` is asked after
gradient sync on every step. Every rank checks the gradients it holds (its own shards under ZeRO,
TP or PP) and the verdict is all-reduced (max), so all ranks skip together. Cost: one fused norm
over the local gradients and an all-reduce of one number per step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from plait.core.comm import world_group
from plait.core.errors import PlaitError
from plait.core.sharding import ParallelRuntime

log = logging.getLogger(__name__)


class NonFiniteGradients(PlaitError):
    """Too many consecutive steps had NaN or Inf gradients: training cannot recover by skipping."""


class NonFiniteGuard(ParallelRuntime):
    """Skips steps with non-finite gradients; raises after `max_consecutive` of them in a row."""

    name = "nonfinite_guard"

    def __init__(self, engine: Any, *, max_consecutive: int) -> None:
        self.engine = engine
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.skipped_total = 0
        self.group = world_group()

    def _local_grads(self) -> list[torch.Tensor]:
        grads = []
        for group in self.engine.optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grad = param.grad
                    grads.append(grad.to_local() if hasattr(grad, "to_local") else grad)
        return grads

    def skip_step(self) -> bool:
        grads = self._local_grads()
        if grads:
            # One norm over all gradients is non-finite iff some element is.
            norms = torch._foreach_norm(grads)
            bad = (~torch.isfinite(torch.stack(norms).float().sum())).float().reshape(1)
        else:
            bad = torch.zeros(1, device=self.engine.device)
        if self.group.size > 1:
            bad = bad.to(self.engine.device)
            self.engine.comm.all_reduce(bad, group=self.group, op="max", purpose="nonfinite_check")
        if bad.item() == 0:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped_total += 1
        step = self.engine.global_step
        log.warning(
            "step %d: non-finite gradients, optimizer step skipped (%d in a row, %d in total)",
            step,
            self.consecutive,
            self.skipped_total,
        )
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteGradients(
                f"step {step}: gradients were NaN/Inf on {self.consecutive} consecutive steps "
                f"(limit resilience.max_consecutive_nonfinite = {self.max_consecutive}); "
                "stopping. Lower the learning rate, check the data around this step, or resume "
                "from an earlier checkpoint"
            )
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive, "skipped_total": self.skipped_total}
