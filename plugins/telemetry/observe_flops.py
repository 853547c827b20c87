"""An observed model's training FLOPs: given per token, or counted once over its first step.

Counting uses torch's `FlopCounterMode` around the whole first step, as plait's engine does
for a model without a formula: the matmuls and attention of forward and backward (the
optimizer's element-wise work is not counted, nor is anything that is not a matmul or
attention; activation recomputation is). The count is this rank's, which for data-parallel
ranks (DDP, FSDP) is one replica's work on this rank's tokens: per token it is the model's
training FLOPs per token, and the job's FLOPs in a step are that times the job's tokens.
A model whose inputs show no tokens is counted per step instead.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from plait.core.errors import PlaitError
from plait.core.flops import register_cpu_attention_flops


def check_flops_per_token(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlaitError(
            f"plait.observe: flops_per_token must be a number (training FLOPs per token, "
            f"forward + backward) or None to count them, got {type(value).__name__}"
        )
    if not math.isfinite(value) or value <= 0:
        raise PlaitError(f"plait.observe: flops_per_token must be finite and > 0, got {value}")
    return float(value)


class ModelFlops:
    """Training FLOPs per token (or per step, when the model's inputs show no tokens)."""

    def __init__(self, flops_per_token: float | None) -> None:
        self.per_token = check_flops_per_token(flops_per_token)
        self.per_step = 0.0  # this rank's, counted, when tokens are unknown
        self._counter: Any = None
        self._stack: contextlib.ExitStack | None = None

    @property
    def known(self) -> bool:
        return self.per_token is not None or self.per_step > 0

    def start_counting(self) -> None:
        """Count the step that begins now (call `stop_counting` at its end)."""
        if self.known or self._stack is not None:
            return
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        register_cpu_attention_flops()
        stack = contextlib.ExitStack()
        # NOTE: torch.compile does not trace under a dispatch mode; a block first called under
        # one would never be compiled afterwards, so the counted step runs compiled code eagerly.
        stance = getattr(torch.compiler, "set_stance", None)
        if stance is not None:
            stack.enter_context(stance("force_eager"))
        self._counter = stack.enter_context(FlopCounterMode(display=False))
        self._stack = stack

    def stop_counting(self, tokens: int | None, *, completed: bool) -> None:
        """End the count; keep it when the step completed (a failed step is counted again)."""
        stack, counter = self._stack, self._counter
        self._stack = self._counter = None
        if stack is None:
            return
        stack.close()
        if not completed:
            return
        total = float(counter.get_total_flops())
        if tokens:
            self.per_token = total / tokens
        else:
            self.per_step = total

    def job_flops(self, rank_tokens: int | None, world_size: int) -> float:
        """The whole job's training FLOPs in a step where this rank saw `rank_tokens`."""
        if self.per_token is not None:
            if not rank_tokens:
                raise PlaitError(
                    "plait.observe: flops_per_token is known but this step's tokens are not "
                    "(the model's inputs hold no integer token ids): pass tokens= to "
                    "observer.step(...)"
                )
            return self.per_token * rank_tokens * world_size
        return self.per_step * world_size
