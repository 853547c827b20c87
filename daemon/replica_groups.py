"""A fault-tolerant job's replica groups as an operator reads them: who participates, the quorum,
what happened to it — plain records, no gRPC (the servicer translates them).

A group **participates** while a rank of its current world is live; it has **left** when its
ranks went silent (stale) or one failed — the same rule that takes its ranks out of the job's
MFU (`plait.daemon.analysis`) —, and **finished** when they all ended their runs. Its replica id,
last quorum id and participants come from the last quorum event it sent
(`plait.daemon.quorum_log`); the job's quorum is the latest any group reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plait.daemon import telemetry_schema as schema
from plait.daemon.analysis import (
    JOB_FAILED,
    JOB_FINISHED,
    JOB_RUNNING,
    RANK_LIVE,
    RANK_SUPERSEDED,
    JobState,
    shown_step,
)
from plait.daemon.quorum_log import QuorumEventRecord, QuorumLog

GROUP_PARTICIPATING = "participating"
GROUP_LEFT = "left"
GROUP_FINISHED = "finished"
GROUP_STATES = (GROUP_PARTICIPATING, GROUP_LEFT, GROUP_FINISHED)
# A group's state from the state its ranks give it (`plait.daemon.analysis.job_state_of`).
_GROUP_STATE = {
    JOB_RUNNING: GROUP_PARTICIPATING,
    JOB_FINISHED: GROUP_FINISHED,
    JOB_FAILED: GROUP_LEFT,
}


@dataclass(frozen=True, slots=True)
class ReplicaGroupView:
    replica_group: int
    state: str  # one of GROUP_STATES
    ranks: tuple[int, ...]  # of its current world, heard here
    ranks_live: int
    step: int  # trainer numbering: steps completed by its furthest rank
    world_size: int
    restarts: int
    replica_id: str = ""  # from its last quorum event ("" before one)
    quorum_id: int = -1
    participants: int = 0


@dataclass(frozen=True, slots=True)
class FaultToleranceView:
    job_id: str
    state: str
    groups: tuple[ReplicaGroupView, ...]
    quorum_id: int  # the latest any group reported (-1: none)
    participants: int
    events: tuple[QuorumEventRecord, ...]  # oldest first
    events_received: int


def group_views(job: JobState, log: QuorumLog | None) -> list[ReplicaGroupView]:
    views = []
    for group, (state, world) in sorted(job.groups.items()):
        members = [
            r
            for r in job.ranks
            if r.window.identity.replica_group == group and r.status != RANK_SUPERSEDED
        ]
        steps = [r.window.last_steps(1)[0].step for r in members if r.window.steps]
        last = log.last_by_group.get(group) if log is not None else None
        views.append(
            ReplicaGroupView(
                replica_group=group,
                state=_GROUP_STATE.get(state, GROUP_LEFT),
                ranks=tuple(sorted(r.window.identity.rank for r in members)),
                ranks_live=sum(r.status == RANK_LIVE for r in members),
                step=shown_step(max(steps)) if steps else 0,
                world_size=world.current_size,
                restarts=world.restarts,
                replica_id=last.figures.replica_id if last else "",
                quorum_id=last.figures.quorum_id if last else -1,
                participants=last.figures.participants if last else 0,
            )
        )
    return views


def fault_tolerance_views(
    jobs: Sequence[JobState], logs: dict[str, QuorumLog | None]
) -> list[FaultToleranceView]:
    """The fault-tolerant jobs among `jobs` (those with replica groups), with their logs."""
    out = []
    for job in jobs:
        if not job.groups or set(job.groups) == {schema.NO_REPLICA_GROUP}:
            continue
        log = logs.get(job.job_id)
        events = tuple(log.events) if log is not None else ()
        latest = max(events, key=lambda e: (e.figures.quorum_id, e.start_ns), default=None)
        out.append(
            FaultToleranceView(
                job_id=job.job_id,
                state=job.state,
                groups=tuple(group_views(job, log)),
                quorum_id=latest.figures.quorum_id if latest else -1,
                participants=latest.figures.participants if latest else 0,
                events=events,
                events_received=log.events_received if log is not None else 0,
            )
        )
    return out
