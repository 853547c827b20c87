"""`PlaitCallback`: a Hugging Face `Trainer` run on plait's node daemon, live MFU and all.

    trainer = Trainer(model=model, args=args, train_dataset=dataset,
                      callbacks=[PlaitCallback()])
    trainer.train()

A thin adapter over `plait.observe`: the trainer's events give the steps (`on_step_begin` /
`on_step_end`, numbered as the trainer's `global_step`) and the optimizer phase
(`on_pre_optimizer_step` / `on_optimizer_step`); the model's own hooks give forward, backward,
the tokens of each batch (`input_ids`) and, under DDP, the gradient buckets; the model's FLOPs
are counted over the first step unless `flops_per_token` is given. The loss the trainer logs
(`on_log`) is the step's loss (each step's model loss on this rank between logs).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from plait.plugins.telemetry.observe import Observer, observe

__all__ = ["PlaitCallback"]


class PlaitCallback(TrainerCallback):  # type: ignore[misc]
    """Reports the `Trainer`'s steps to the node daemon (see the module docstring)."""

    def __init__(
        self,
        *,
        job_id: str | None = None,
        daemon: str | None = None,
        flops_per_token: float | None = None,
    ) -> None:
        self.job_id, self.daemon, self.flops_per_token = job_id, daemon, flops_per_token
        self.observer: Observer | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if self.observer is None and model is not None:
            self.observer = observe(
                model,
                job_id=self.job_id,
                daemon=self.daemon,
                flops_per_token=self.flops_per_token,
            )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.observer is not None:
            self.observer.release()  # the previous step, when no log came for it
            self.observer.begin_step(number=state.global_step)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.observer is not None:
            self.observer.optimizer_started()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.observer is not None:
            self.observer.optimizer_finished()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.observer is not None:
            self.observer.end_step(hold=True)  # logging comes after the step's end

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if self.observer is not None and logs and "loss" in logs:
            self.observer.set_loss(logs["loss"])
            self.observer.release()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.observer is not None:
            self.observer.close()
            self.observer = None
