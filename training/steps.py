"""Where a training step comes from: one engine step on the next batch, or — when
`[fault_tolerance]` names a replica group — a step tried until the groups' quorum commits it.

Both answer `run(step)` with the step that ran (a healed group continues at its peer's step),
its loss and the engine's report, so the loop holds no branch for fault tolerance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from plait.core.step import StepReport

if TYPE_CHECKING:
    from rich.console import Console

    from plait.core.config import PlaitConfig
    from plait.core.engine import Engine
    from plait.plugins.data.step_sampler import StepSampler
    from plait.plugins.fault_tolerance import FaultTolerantSteps


@dataclass(frozen=True, slots=True)
class RanStep:
    """One step as it ran: its 0-based index, the loss and the engine's report of it."""

    step: int
    loss: float
    report: StepReport


class StepSource(Protocol):
    # Whether this rank's group writes the job's checkpoint after the step that just ran.
    writes_checkpoints: bool

    def resume_from(self, step: int) -> None: ...

    def run(self, step: int) -> RanStep: ...

    def close(self) -> None: ...


class EngineSteps:
    """The plain loop's steps: the engine's `train_step` on the sampler's next batch."""

    writes_checkpoints = True

    def __init__(self, engine: Engine, batches: StepSampler) -> None:
        self.engine = engine
        self.batches = batches

    def resume_from(self, step: int) -> None:
        del step  # the sampler's position came back with the checkpoint

    def run(self, step: int) -> RanStep:
        data_start = time.time_ns()
        loss = self.engine.train_step(self.batches.next_batch(), data_start_ns=data_start)
        return RanStep(step, loss, _last_report(self.engine))

    def close(self) -> None:
        pass


class ReplicaGroupSteps:
    """A fault-tolerant group's steps: each retried until it commits with the live groups. The
    group's rank 0 logs the quorum's events and sends them to the daemon."""

    def __init__(self, steps: FaultTolerantSteps, *, leader: bool, console: Console) -> None:
        self.steps = steps
        self.leader = leader
        self.console = console

    @property
    def writes_checkpoints(self) -> bool:
        return self.steps.writes_checkpoints

    def resume_from(self, step: int) -> None:
        self.steps.resume_from(step)

    def run(self, step: int) -> RanStep:
        del step  # torchft counts the steps: a healed group continues at its peer's
        outcome = self.steps.step_until_committed(data_start_ns=time.time_ns())
        if self.leader and outcome.events:
            from plait.plugins.fault_tolerance.quorum_events import publish_quorum_events

            publish_quorum_events(outcome.events, replica_id=self.steps.replica_id)
            for event in outcome.events:
                # A failed commit carries the peer's error, Gloo's `[/path/pair.cc:553]`
                # included: plain text, never markup.
                self.console.print(event.describe(), highlight=False, soft_wrap=True, markup=False)
        return RanStep(outcome.step, outcome.loss, _last_report(self.steps.engine))

    def close(self) -> None:
        self.steps.close()


def step_source(
    engine: Engine, batches: StepSampler, config: PlaitConfig, console: Console
) -> StepSource:
    """Replica-group steps when `[fault_tolerance]` names a group, else the engine's. Joining
    comes before the NaN/Inf guard is attached, so the guard judges the gradients averaged
    across the groups and every group skips (or takes) a step alike."""
    from plait.plugins.fault_tolerance.config import fault_tolerance_config

    settings = fault_tolerance_config(config)
    if not settings.enabled:
        return EngineSteps(engine, batches)
    from plait.plugins.fault_tolerance import FaultTolerantSteps

    steps = FaultTolerantSteps.attach(engine, batches, settings)
    return ReplicaGroupSteps(steps, leader=engine.mesh.rank == 0, console=console)


def _last_report(engine: Engine) -> StepReport:
    report = engine.last_report
    assert report is not None, "a step ran without a report"
    return report
