"""`PlaitCallback` for Lightning: a `lightning.pytorch.Trainer` run on plait's node daemon.

    trainer = lightning.pytorch.Trainer(..., callbacks=[PlaitCallback()])

A thin adapter over `plait.observe`. Lightning calls `training_step` directly, not through the
module's `forward`, so the phases come from Lightning's own hooks: a step starts at
`on_train_batch_start` (one step per optimizer step: accumulated batches join the open one),
forward runs until `on_before_backward`, backward through the loss until autograd finishes
the pass (`on_after_backward` comes after DDP's wait for its buckets), the optimizer from
`on_before_optimizer_step` (Lightning calls it after the closure that ran forward and backward)
to the end of the torch optimizer's `step` (its post hook). Tokens are the batch's integer ids,
the loss is `training_step`'s, and under the DDP strategy the gradient buckets of Lightning's
DDP wrapper are timed as for a plain DDP loop.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn

from plait.plugins.telemetry.observe import Observer, count_tokens

__all__ = ["PlaitCallback"]


class PlaitCallback(pl.Callback):  # type: ignore[misc]
    """Reports a Lightning run's optimizer steps to the node daemon."""

    def __init__(
        self,
        *,
        job_id: str | None = None,
        daemon: str | None = None,
        flops_per_token: float | None = None,
    ) -> None:
        self.job_id, self.daemon, self.flops_per_token = job_id, daemon, flops_per_token
        self.observer: Observer | None = None
        self._stepped = False
        self._hooks: list[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.observer is not None:
            return
        wrapper = getattr(trainer.strategy, "model", None)
        ddp = isinstance(wrapper, nn.parallel.DistributedDataParallel)
        self.observer = Observer(
            wrapper if ddp else pl_module,
            optimizer=None,
            job_id=self.job_id,
            daemon=self.daemon,
            flops_per_token=self.flops_per_token,
            module_hooks=False,
        )
        for optimizer in trainer.optimizers:
            self._hooks.append(optimizer.register_step_post_hook(self._optimizer_stepped))

    def _optimizer_stepped(self, *_: Any) -> None:
        if self.observer is not None:
            self.observer.optimizer_finished()
        self._stepped = True

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        observer = self.observer
        if observer is None:
            return
        if not observer.step_open:
            observer.begin_step(number=trainer.global_step)
        observer.forward_started(count_tokens((batch,), {}))

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any
    ) -> None:
        if self.observer is not None:
            self.observer.forward_finished()
            self.observer.note_loss(loss)
            # Ends when autograd finishes, before DDP waits for its last buckets (their tail
            # is exposed communication, not backward).
            self.observer.watch_backward(loss)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.observer is not None:
            self.observer.backward_finished()

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.observer is not None:
            self.observer.optimizer_started()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.observer is not None and self._stepped:
            self._stepped = False
            self.observer.end_step()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close("failed")

    def _close(self, outcome: str | None = None) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.observer is not None:
            self.observer.close(outcome)
            self.observer = None
