"""The engine-owned callbacks around one micro-batch's compute.

The engine's own forward/backward handlers and a runtime that runs the compute itself (a
pipeline stage) go through the same `MicrobatchRunner`, so every runtime sees the same
`before_forward` / `before_backward` calls, with positions taken from the schedule's actions,
and every loss is computed, averaged and scaled in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from plait.core.schedule import Action, Backward, Forward, MicrobatchPosition
from plait.core.token_loss import TokenWeights

if TYPE_CHECKING:
    from plait.core.sharding import ParallelRuntime, StepState

LossFn = Callable[[Any, Any], torch.Tensor]


class MicrobatchRunner:
    """Calls the runtimes' per-micro-batch hooks and computes the loss of one step."""

    def __init__(
        self,
        *,
        runtimes: Sequence[ParallelRuntime],
        loss_fn: LossFn,
        positions: dict[Action, MicrobatchPosition],
        num_microbatches: int,
        weights: TokenWeights | None = None,
    ) -> None:
        self.runtimes = tuple(runtimes)
        self.loss_fn = loss_fn
        self.positions = positions
        self.num_microbatches = num_microbatches
        self.weights = weights

    def position(self, action: Forward | Backward) -> MicrobatchPosition:
        try:
            return self.positions[action]
        except KeyError:
            raise KeyError(f"{action!r} is not a compute action of this step's schedule") from None

    def before_forward(self, action: Forward) -> None:
        position = self.position(action)
        for runtime in self.runtimes:
            runtime.before_forward(position)

    def before_backward(self, action: Backward) -> None:
        """Call before a backward runs; the input half of a split backward produces no weight
        gradients, so runtimes are not told about it."""
        if action.kind == "input":
            return
        position = self.position(action)
        for runtime in self.runtimes:
            runtime.before_backward(position)

    def loss(self, state: StepState, microbatch: int, output: Any) -> torch.Tensor:
        """The micro-batch's loss from the model output: recorded (detached) for the step's mean
        and returned weighted for backward — by its share of the global batch's scored tokens
        (`plait.core.token_loss`), or 1 / the micro-batch count when the loss cannot be weighed
        — and scaled by the runtimes (fp16 loss scaling)."""
        loss = self.loss_fn(output, state.targets[microbatch])
        state.losses[microbatch] = loss.detach()
        if self.weights is None:
            scaled = loss / self.num_microbatches
        else:
            scaled = self.weights.weigh(microbatch, loss)
        for runtime in self.runtimes:
            scaled = runtime.scale_loss(scaled)
        return scaled
