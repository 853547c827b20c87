"""Jobs in the daemon CLI's tables: state, worlds and restarts, stale ranks, expert load.

A job's ranks may report to several daemons (one per node); each daemon says what it sees, and
these functions combine the answers of the daemons on the job's newest world
(`plait.daemon.worlds`; a daemon whose ranks an elastic shrink left behind counts for
nothing): the job runs while any of them sees a live rank, its worlds are the longest history
kept (an older world another daemon saw comes first), stale ranks add up. The expert load is
the job's (every rank reports the whole job's counts), taken from the first daemon on the
newest world that has it.
"""

from __future__ import annotations

from collections.abc import Mapping

from plait.daemon.job_reports import ExpertRow, JobWorld
from plait.tools.daemon_tables import Column, percent


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
