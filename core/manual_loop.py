"""`engine(batch)`, `engine.backward(loss)`, `engine.step()`: a loop that drives the step itself.

DeepSpeed's engine API, for loops that do more per micro-batch than `train_step` allows (several
losses, a custom backward, logging between calls). The same runtime callbacks run as under a
schedule: the k-th forward and backward of an accumulation window of
`train.gradient_accumulation_steps` micro-batches get positions `first = (k == 0)`,
`last = (k == n - 1)`, so data parallelism reduces on the last backward only, and the loss is
divided by n so gradients equal `train_step` over the same micro-batches.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from plait.core.batches import input_tokens
from plait.core.errors import PlaitError
from plait.core.schedule import MicrobatchPosition
from plait.core.step import PhaseSpan

if TYPE_CHECKING:
    from plait.core.engine import Engine


class ManualLoop:
    """The accumulation window of one optimizer step driven by the user's own calls."""

    def __init__(self, engine: Engine) -> None:
        if engine.mesh.size("pp") > 1:
            raise PlaitError(
                "engine(batch) / engine.backward(loss) / engine.step() drive one stage; with "
                "pipeline parallelism the schedule runs every micro-batch: use "
                "engine.train_step(batch)"
            )
        if engine.context.microbatch_cuts:
            raise PlaitError(
                "engine(batch) / engine.backward(loss) / engine.step() take whole sequences; "
                "with context parallelism (parallel.cp > 1) the engine shards each sequence: "
                "use engine.train_step(batch)"
            )
        self.engine = engine
        self.num_microbatches = engine.config.train.gradient_accumulation_steps
        self._reset()

    def _reset(self) -> None:
        self.forwards = 0
        self.backwards = 0
        self.tokens = 0
        self.losses: list[torch.Tensor] = []
        self.spans: list[PhaseSpan] = []
        self.start_ns = 0
        self.lr = 0.0

    def _position(self, index: int, *, backward: bool) -> MicrobatchPosition:
        n = self.num_microbatches
        consumed = any(rt.gradients_consumed_each_microbatch for rt in self.engine.runtimes)
        last = index == n - 1
        return MicrobatchPosition(
            microbatch=index,
            chunk=0,
            num_microbatches=n,
            index=index,
            first=index == 0,
            last=last,
            gradients_final=backward and (last or consumed),
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if self.forwards == 0:
            self.start_ns = time.time_ns()
            engine.begin_step()
            self.lr = engine.optimizer.param_groups[0]["lr"]
        if self.forwards >= self.num_microbatches:
            raise PlaitError(
                f"engine(...) called {self.forwards + 1} times in one accumulation window of "
                f"train.gradient_accumulation_steps = {self.num_microbatches}; call "
                "engine.backward(loss) and engine.step() after each forward"
            )
        position = self._position(self.forwards, backward=False)
        for runtime in engine.runtimes:
            runtime.before_forward(position)
        if kwargs and not args:
            # A packed batch gets its documents, or is refused for a model that cannot mask them,
            # as in `train_step` (read before the move: no device sync).
            kwargs = engine.document_inputs.prepare(kwargs)
        args, kwargs = engine.to_device((args, kwargs))
        self.tokens += input_tokens((args, kwargs)).numel()
        start = time.time_ns()
        output = engine.module(*args, **kwargs)
        self._span("forward", start, position.microbatch)
        self.forwards += 1
        return output

    def backward(self, loss: torch.Tensor) -> None:
        if self.backwards >= self.forwards:
            raise PlaitError("engine.backward(loss) without a forward: call engine(...) first")
        position = self._position(self.backwards, backward=True)
        for runtime in self.engine.runtimes:
            runtime.before_backward(position)
        self.losses.append(loss.detach())
        scaled = loss / self.num_microbatches
        for runtime in self.engine.runtimes:
            scaled = runtime.scale_loss(scaled)
        start = time.time_ns()
        scaled.backward()
        self._span("backward", start, position.microbatch)
        self.backwards += 1

    def step(self) -> bool:
        if self.backwards < self.num_microbatches:
            if self.backwards < self.forwards:
                raise PlaitError("engine.step() before engine.backward(loss) of the last forward")
            return False
        engine = self.engine
        start = time.time_ns()
        engine.sync_gradients()
        self._span("sync_gradients", start, None)
        start = time.time_ns()
        engine.optimizer_step()
        self._span("optimizer", start, None)
        engine.end_step(
            losses=self.losses,
            tokens=self.tokens,
            lr=self.lr,
            spans=self.spans,
            start_ns=self.start_ns,
        )
        self._reset()
        return True

    def _span(self, name: str, start_ns: int, microbatch: int | None) -> None:
        self.spans.append(
            PhaseSpan(name=name, start_ns=start_ns, end_ns=time.time_ns(), microbatch=microbatch)
        )
