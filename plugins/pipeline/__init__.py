"""The pipeline plugin: GPipe, 1F1B, interleaved 1F1B and ZB-H1 schedules as plain action lists.

`schedules` builds the per-rank programs, `checker` verifies any set of programs (matching,
ordering, deadlock freedom), `timeline` simulates and draws them. The stage split and the
point-to-point runtime plug in through `plait_shard` and the core executor.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.core.hookspecs import hookimpl
from plait.core.records import ScheduleRecord
from plait.core.schedule import Action, ScheduleRequest
from plait.plugins.pipeline.schedules import SCHEDULES, build_schedule


@hookimpl
def plait_register_schedules() -> Sequence[ScheduleRecord]:
    return [
        ScheduleRecord(
            name=schedule.name,
            pipelined=True,
            supports_virtual_stages=schedule.supports_virtual_stages,
            description=schedule.description,
        )
        for schedule in SCHEDULES.values()
    ]


@hookimpl(trylast=True)
def plait_schedule(request: ScheduleRequest) -> list[Action] | None:
    if request.name not in SCHEDULES:
        return None
    return build_schedule(request)
