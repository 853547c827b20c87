"""The default schedule: gradient accumulation over micro-batches on one pipeline stage.

For every micro-batch: forward, then backward; then one gradient sync and one optimizer step.
Data-parallel strategies skip the reduction on all but the last backward (`before_backward`).
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.core.errors import ScheduleError
from plait.core.hookspecs import hookimpl
from plait.core.records import ScheduleRecord
from plait.core.schedule import (
    Action,
    Backward,
    Forward,
    OptimizerStep,
    ScheduleRequest,
    SyncGradients,
)

NAME = "accumulate"


def accumulate_actions(num_microbatches: int) -> list[Action]:
    actions: list[Action] = []
    for mb in range(num_microbatches):
        actions += [Forward(microbatch=mb), Backward(microbatch=mb)]
    return [*actions, SyncGradients(), OptimizerStep()]


@hookimpl
def plait_register_schedules() -> Sequence[ScheduleRecord]:
    return [ScheduleRecord(name=NAME, description="gradient accumulation, no pipeline")]


@hookimpl(trylast=True)
def plait_schedule(request: ScheduleRequest) -> list[Action] | None:
    if request.name != NAME:
        return None
    if request.num_stages != 1:
        raise ScheduleError(
            f"schedule {NAME!r} runs a single pipeline stage, but pp = {request.num_stages}; "
            "choose a pipeline schedule (gpipe, 1f1b, interleaved_1f1b, zb_h1)"
        )
    return accumulate_actions(request.num_microbatches)
