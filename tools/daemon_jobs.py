"""Jobs in the daemon CLI's tables: state, worlds and restarts, stale ranks, expert load.

A job's ranks may report to several daemons (one per node); each daemon says what it sees, and
these functions combine the answers of the daemons on the job's newest world
(`plait.tools.daemon_worlds`; a daemon whose ranks an elastic shrink left behind counts for
nothing): the job runs while any of them sees a live rank, its worlds are the longest history
kept (an older world another daemon saw comes first), stale ranks add up. The expert load is
the job's (every rank reports the whole job's counts), taken from the first daemon on the
newest world that has it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from plait.proto.plait.v1 import daemon_pb2, metrics_pb2
from plait.tools.daemon_tables import Column, percent
from plait.tools.daemon_worlds import JobAnswers, superseded_jobs

MAX_WORLDS_SHOWN = 32  # as many as a daemon keeps (plait.daemon.store.MAX_WORLDS_KEPT)

# As plait.daemon.analysis names them (not imported: the CLI starts without the daemon).
RUNNING, FINISHED, FAILED, STALE = "running", "finished", "failed", "stale"


def combined_state(states: Sequence[str]) -> str:
    """One job state from each daemon's: failed wins, then running, then finished by all."""
    known = [s for s in states if s]
    if not known:
        return ""
    if FAILED in known:
        return FAILED
    if RUNNING in known:
        return RUNNING
    if all(s == FINISHED for s in known):
        return FINISHED
    return STALE


@dataclass(frozen=True, slots=True)
class JobWorld:
    state: str = ""
    world_sizes: tuple[int, ...] = ()
    restarts: int = 0
    started_step: int = 0  # first step of the current world, trainer numbering
    ranks_stale: int = 0

    @property
    def worlds(self) -> str:
        """ "2 → 1": the sizes of the job's worlds, oldest first (the last four)."""
        sizes = [str(s) for s in self.world_sizes[-4:]]
        return ("… → " if len(self.world_sizes) > 4 else "") + " → ".join(sizes)


def job_world(answers: JobAnswers) -> JobWorld:
    """One job's world as several daemons see it."""
    current = answers.current
    longest = max(current, key=lambda j: (j.restarts, len(j.world_sizes)))
    sizes, restarts = tuple(longest.world_sizes), longest.restarts
    if answers.older:
        # A daemon that saw only the older world knows where the history began.
        before = max(answers.older, key=lambda j: (j.restarts, len(j.world_sizes)))
        if before.restarts >= restarts:
            sizes = (*before.world_sizes, answers.newest.world_size)[-MAX_WORLDS_SHOWN:]
            restarts = before.restarts + 1
    return JobWorld(
        state=combined_state([j.state for j in current]),
        world_sizes=sizes,
        restarts=restarts,
        started_step=max(j.world_started_step for j in current),
        ranks_stale=sum(j.ranks_stale for j in current),
    )


def world_columns(get: str = "world") -> list[Column]:
    """State, worlds, restarts, the world's first step and stale ranks, for rows with a
    `JobWorld` at attribute `get`."""

    def world(row: object) -> JobWorld:
        return getattr(row, get)

    return [
        Column("state", lambda j: world(j).state or "-", "left"),
        Column("worlds", lambda j: world(j).worlds if world(j).restarts else "-"),
        Column("restarts", lambda j: str(world(j).restarts) if world(j).restarts else "-"),
        Column(
            "since step",
            lambda j: str(world(j).started_step) if world(j).restarts else "-",
            wide_only=True,
        ),
        Column("stale", lambda j: str(world(j).ranks_stale) if world(j).ranks_stale else "-"),
    ]


@dataclass(frozen=True, slots=True)
class ExpertRow:
    job_id: str
    load: metrics_pb2.ExpertLayerLoad


def expert_rows(responses: Sequence[daemon_pb2.GetMetricsResponse]) -> list[ExpertRow]:
    """Each MoE job's layers, from the first daemon on its newest world that reports them."""
    superseded = superseded_jobs({str(i): r for i, r in enumerate(responses)})
    rows: dict[str, list[ExpertRow]] = {}
    for index, response in enumerate(responses):
        for job in response.jobs:
            if job.job_id in superseded[str(index)]:
                continue
            if job.expert_load and job.job_id not in rows:
                rows[job.job_id] = [ExpertRow(job.job_id, layer) for layer in job.expert_load]
    return [row for job_id in sorted(rows) for row in rows[job_id]]


def expert_columns(jobs: Mapping[str, str]) -> list[Column[ExpertRow]]:
    return [
        Column("job", lambda r: jobs.get(r.job_id, r.job_id), "left", keep_empty=True),
        Column("layer", lambda r: r.load.layer, "left", keep_empty=True),
        Column("experts", lambda r: str(r.load.experts)),
        Column("step", lambda r: str(r.load.step)),
        Column("max/mean", lambda r: f"{r.load.imbalance:.2f}", keep_empty=True),
        Column("window max/mean", lambda r: f"{r.load.mean_imbalance:.2f}"),
        Column("tokens", lambda r: str(r.load.tokens), wide_only=True),
        Column("busiest", lambda r: str(r.load.max_tokens), wide_only=True),
        Column("dropped", lambda r: str(r.load.dropped) if r.load.dropped else "-"),
        Column("dropped %", lambda r: percent(r.load.dropped_fraction) if r.load.dropped else "-"),
    ]
