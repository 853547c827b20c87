"""The CLI's merge of one job's answers from several daemons, on messages (no daemon needed).

`test_daemon_worlds_two_nodes.py` plays a real shrink on two daemons; these cases pin the rule
of `plait.daemon.worlds` where timing cannot be arranged with processes: a world seen by
two daemons a moment apart, a failed old world, a daemon that only knows the new world.
"""

from __future__ import annotations

from plait.daemon.job_reports import aggregate_jobs
from plait.daemon.worlds import superseded_jobs, without_jobs
from plait.proto.plait.v1 import daemon_pb2, metrics_pb2
from plait.tools.daemon_views import TopView

S = 10**9  # one second in ns


def answer(
    world: int, started: int, heard: int, *, state: str = "running", reporting: int = 1,
    stale: int = 0, sizes: tuple[int, ...] = (), restarts: int = 0, rank: int = 0,
) -> daemon_pb2.GetMetricsResponse:  # fmt: skip
    job = metrics_pb2.JobMetrics(
        job_id="j", world_size=world, ranks_reporting=reporting, ranks_stale=stale, state=state,
        world_sizes=sizes or (world,), restarts=restarts, tokens_per_second=1000.0,
        model_flops_per_second=1e12, peak_flops=1e13, step=7,
        world_started_unix_nano=started * S, last_heard_unix_nano=heard * S,
    )  # fmt: skip
    ranks = [metrics_pb2.RankMetrics(job_id="j", rank=rank, status="stale" if stale else "live")]
    return daemon_pb2.GetMetricsResponse(jobs=[job], ranks=ranks)


def test_one_world_seen_by_two_daemons_a_moment_apart_adds_up() -> None:
    a = answer(2, started=100, heard=200, rank=0)
    b = answer(2, started=101, heard=199, rank=1)  # first heard a second later, still live
    (job,) = aggregate_jobs([a, b])
    assert (job.ranks_reporting, job.world_size, job.tokens_per_second) == (2, 2, 2000.0)
    assert superseded_jobs({"a": a, "b": b}) == {"a": set(), "b": set()}
    assert [r.rank for r in TopView.from_latest({"a": a, "b": b}).ranks] == [0, 1]


def test_the_older_world_left_on_another_daemon_is_superseded() -> None:
    a = answer(1, started=300, heard=400, sizes=(2, 1), restarts=1, rank=0)
    b = answer(2, started=100, heard=250, state="stale", reporting=0, stale=1, rank=1)
    (job,) = aggregate_jobs([a, b])
    assert (job.ranks_reporting, job.world_size, job.world.ranks_stale) == (1, 1, 0)
    assert (job.world.state, job.world.world_sizes, job.world.restarts) == ("running", (2, 1), 1)
    assert job.tokens_per_second == 1000.0
    assert superseded_jobs({"a": a, "b": b}) == {"a": set(), "b": {"j"}}
    assert [(r.rank, r.status) for r in TopView.from_latest({"a": a, "b": b}).ranks] == [
        (0, "live")
    ]
    shown = TopView.from_latest({"a": a, "b": b}, show_superseded=True).ranks
    assert [(r.rank, r.status) for r in shown] == [(0, "live"), (1, "superseded")]
    # The rank's own message is left as the daemon sent it.
    assert b.ranks[0].status == "stale"
    breakdown = daemon_pb2.GetBottleneckResponse(
        ranks=[metrics_pb2.BottleneckBreakdown(job_id="j", rank=1),
               metrics_pb2.BottleneckBreakdown(job_id="other", rank=0)],
        stragglers=[metrics_pb2.StragglerScore(job_id="j", rank=1)],
    )  # fmt: skip
    kept = without_jobs(breakdown, {"j"})
    assert [(r.job_id, r.rank) for r in kept.ranks] == [("other", 0)] and not kept.stragglers


def test_a_failed_older_world_does_not_fail_the_running_job() -> None:
    a = answer(1, started=300, heard=400, sizes=(2, 1), restarts=1)
    b = answer(2, started=100, heard=250, state="failed", reporting=1)  # its rank said "failed"
    (job,) = aggregate_jobs([a, b])
    assert (job.world.state, job.ranks_reporting, job.world_size) == ("running", 1, 1)


def test_a_daemon_that_knows_only_the_new_world_gets_the_history_from_the_other() -> None:
    a = answer(1, started=300, heard=400)  # a daemon started after the shrink: [1], 0 restarts
    b = answer(2, started=100, heard=250, state="stale", reporting=0, stale=1)
    (job,) = aggregate_jobs([a, b])
    assert (job.world.world_sizes, job.world.restarts) == ((2, 1), 1)


def test_ranks_of_one_world_that_reported_one_after_the_other_still_add_up() -> None:
    """No new world formed (same size, no restart anywhere): the ranks on daemon A merely
    finished before those on daemon B began; both belong to the one world."""
    a = answer(2, started=100, heard=150, rank=0)
    b = answer(2, started=160, heard=200, rank=1)
    (job,) = aggregate_jobs([a, b])
    assert (job.ranks_reporting, job.world_size) == (2, 2)
    assert superseded_jobs({"a": a, "b": b}) == {"a": set(), "b": set()}
