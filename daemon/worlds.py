"""One job's world across several daemons: the newest one, and the daemons still on an older one.

Each daemon (one per node) knows only the ranks that report to it. After an elastic shrink the
node that was lost keeps its last world: its daemon still says "world 2, rank 1 stale" while the
survivor's says "world 1, running". Merged naively, `plait top --host A --host B` would read
ranks 1/2 with one stale rank.

The rule, the daemon's own (`plait.daemon.store.JobWorlds.is_member`) applied across daemons:
the job's **newest world** is the one that started last on any daemon
(`JobMetrics.world_started_unix_nano`). A daemon is **on the newest world** when its current
world is that one, or when it heard from a rank of its current world at or after the newest
world started (`last_heard_unix_nano`): a rank live then belongs to the live world, whichever
daemon saw the world first. A daemon whose ranks fell silent before the newest world started
is on an older world when a new one did form — the newest has another size, or its daemon saw
more worlds — and its ranks are then **superseded** wherever they were seen: they count for
nothing (not reporting, not stale, no throughput) and their rows say "superseded".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from plait.proto.plait.v1 import daemon_pb2, metrics_pb2

SUPERSEDED = "superseded"  # a rank's status, as plait.daemon.analysis names it


def newest_world(jobs: Sequence[metrics_pb2.JobMetrics]) -> metrics_pb2.JobMetrics:
    """The answer (of one job, from several daemons) whose current world started last."""
    return max(jobs, key=lambda j: (j.world_started_unix_nano, j.restarts))


def on_newest_world(job: metrics_pb2.JobMetrics, newest: metrics_pb2.JobMetrics) -> bool:
    started = newest.world_started_unix_nano
    if job.world_started_unix_nano >= started or job.last_heard_unix_nano >= started:
        return True
    # Silent since before the newest world started: an older world only if a new one did
    # form (another size, or more worlds seen where the newest is); otherwise the same world,
    # whose ranks on this daemon merely finished their part before another daemon's began.
    return newest.world_size == job.world_size and newest.restarts <= job.restarts


@dataclass(frozen=True, slots=True)
class JobAnswers:
    """One job's answers from every daemon, split by world."""

    current: list[metrics_pb2.JobMetrics]  # daemons on the newest world (never empty)
    older: list[metrics_pb2.JobMetrics]  # daemons whose ranks are all superseded

    @property
    def newest(self) -> metrics_pb2.JobMetrics:
        return newest_world(self.current)


def split_by_world(jobs: Sequence[metrics_pb2.JobMetrics]) -> JobAnswers:
    newest = newest_world(jobs)
    return JobAnswers(
        current=[j for j in jobs if on_newest_world(j, newest)],
        older=[j for j in jobs if not on_newest_world(j, newest)],
    )


def superseded_jobs(
    responses: Mapping[str, daemon_pb2.GetMetricsResponse],
) -> dict[str, set[str]]:
    """Host -> the jobs whose ranks on that host belong to an older world than another
    host's (empty for a job seen by one host only)."""
    by_job: dict[str, list[tuple[str, metrics_pb2.JobMetrics]]] = {}
    for host, response in responses.items():
        for job in response.jobs:
            by_job.setdefault(job.job_id, []).append((host, job))
    out: dict[str, set[str]] = {host: set() for host in responses}
    for job_id, answers in by_job.items():
        newest = newest_world([job for _, job in answers])
        for host, job in answers:
            if not on_newest_world(job, newest):
                out[host].add(job_id)
    return out


def current_ranks(
    ranks_by_host: Mapping[str, Iterable[metrics_pb2.RankMetrics]],
    superseded: Mapping[str, set[str]],
    *,
    keep_superseded: bool,
) -> list[metrics_pb2.RankMetrics]:
    """Every host's rank rows; those of a superseded job on their host say so (kept only with
    `keep_superseded`, as a daemon keeps its own superseded ranks only when asked)."""
    out = []
    for host, ranks in ranks_by_host.items():
        for rank in ranks:
            if rank.job_id in superseded.get(host, set()):
                if not keep_superseded:
                    continue
                rank = marked_superseded(rank)
            out.append(rank)
    return out


def marked_superseded(
    rank: metrics_pb2.RankMetrics | metrics_pb2.RankInfo,
) -> metrics_pb2.RankMetrics | metrics_pb2.RankInfo:
    copy = type(rank)()
    copy.CopyFrom(rank)
    copy.status = SUPERSEDED
    return copy


def without_jobs(
    response: daemon_pb2.GetBottleneckResponse, jobs: set[str]
) -> daemon_pb2.GetBottleneckResponse:
    """`response` less the breakdowns and straggler scores of `jobs` (a host's superseded)."""
    if not jobs:
        return response
    kept = daemon_pb2.GetBottleneckResponse()
    kept.CopyFrom(response)
    del kept.ranks[:]
    del kept.stragglers[:]
    kept.ranks.extend(r for r in response.ranks if r.job_id not in jobs)
    kept.stragglers.extend(s for s in response.stragglers if s.job_id not in jobs)
    return kept
