"""Validation loss on the held-out split, every `train.eval_every` steps of `plait train`.

The held-out windows are the end of the token stream (`build_batches(..., split="validation")`);
each validation reads the same first `train.eval_batches` global batches of them, so successive
figures compare the model, not the sample. Forward only, under `torch.no_grad()`, micro-batch by
micro-batch as training splits them; like the training loss, the figure is the mean over every
scored token of the held-out batches on all data-parallel ranks (packed rows and padding score
different numbers of tokens), or the mean of micro-batch losses for a loss plait cannot weigh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait.core.batches import call_model, split_batch
from plait.core.errors import ConfigError

if TYPE_CHECKING:
    from plait.core.engine import Engine
    from plait.plugins.data import TokenBatches


def check_validation_layout(engine: Engine) -> None:
    """Validation runs whole sequences through one module: refuse layouts that split them."""
    split = [axis for axis in ("pp", "cp") if engine.mesh.size(axis) > 1]
    if split:
        degrees = ", ".join(f"parallel.{axis} = {engine.mesh.size(axis)}" for axis in split)
        raise ConfigError(
            f"train.eval_every = {engine.config.train.eval_every} needs whole sequences on one "
            f"module, but {degrees} splits them; set train.eval_every = 0 for this layout"
        )


class Validation:
    """The held-out batches of this rank and the loss of the engine's model on them."""

    def __init__(self, engine: Engine, batches: TokenBatches) -> None:
        check_validation_layout(engine)
        self.engine = engine
        self.batches = [batches.batch_at(i) for i in range(engine.config.train.eval_batches)]
        self.every = engine.config.train.eval_every
        self._group = engine.mesh.group("dp")  # created now: creating a group is collective

    def due(self, steps_done: int, *, last: bool) -> bool:
        return steps_done % self.every == 0 or last

    def loss_after(self, steps_done: int) -> float | None:
        """The held-out loss when validation is due after `steps_done` steps (every
        `train.eval_every` and after the last), else None."""
        if not self.due(steps_done, last=steps_done == self.engine.config.train.steps):
            return None
        return self.loss()

    @torch.no_grad()
    def loss(self) -> float:
        """Mean held-out loss, the same on every rank (a collective: every rank calls it)."""
        engine = self.engine
        module = engine.module
        was_training = module.training
        module.eval()
        try:
            losses, counts = [], []
            for batch in self.batches:
                micro = split_batch(
                    batch,
                    micro_batch_size=engine.config.train.micro_batch_size,
                    device=engine.device,
                )
                for inputs, targets in zip(micro.inputs, micro.targets, strict=True):
                    output = call_model(module, inputs)
                    losses.append(engine.loss_fn(output, targets).detach().double().reshape(()))
                    counts.append(engine.scored_tokens(inputs, targets))
        finally:
            module.train(was_training)
        means = torch.stack(losses).to(engine.device)
        if all(count is not None for count in counts):
            weights = torch.stack([c.to(engine.device, torch.float64) for c in counts])
            # A micro-batch that scores no token has a NaN mean and weighs nothing.
            means = torch.where(weights > 0, means, torch.zeros_like(means))
        else:
            weights = torch.ones_like(means)
        totals = torch.stack([(means * weights).sum(), weights.sum()])
        if self._group.size > 1:
            engine.comm.all_reduce(totals, group=self._group, op="sum", purpose="metrics")
        return (totals[0] / totals[1]).item()
