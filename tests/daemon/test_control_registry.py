"""The daemon's control registry on a clock the test moves: who polls, refusals with reasons,
orders until acknowledged, start-step planning and misses, limits, ranks that go quiet."""

from __future__ import annotations

import threading

import pytest

from plait.daemon.control import FORGET_AFTER_SECONDS, ControlRegistry
from plait.daemon.control_records import (
    DELIVERED,
    LEFT,
    MAX_STEP,
    NOT_POLLING,
    NOT_READY,
    OVER_LIMIT,
    PROFILE,
    STACKS,
    TIMED_OUT,
    UNKNOWN_RANK,
    Chunk,
    ControlLimits,
    EndpointView,
    ProfileSpec,
    RankHello,
    Refusal,
    first_common_step,
    steps_for_seconds,
)

S = 1_000_000_000  # one second in ns


def hello(rank: int, step: int = 0, job: str = "job", **kw: object) -> RankHello:
    return RankHello(job_id=job, rank=rank, world_size=2, host=f"h{rank}", pid=10 + rank,
                     step=step, **kw)  # type: ignore[arg-type]  # fmt: skip


@pytest.fixture
def registry() -> ControlRegistry:
    return ControlRegistry(ControlLimits(poll_patience_seconds=5, max_rank_bytes=100,
                                         max_request_bytes=150, max_captures=2))  # fmt: skip


def test_unknown_job_and_a_job_that_never_polled_are_told_apart(registry: ControlRegistry) -> None:
    with pytest.raises(Refusal) as unknown:
        registry.open(STACKS, "ghost", [], now_ns=0, known_jobs={"other"})
    assert unknown.value.code == "not_found" and "it knows: other" in str(unknown.value)
    with pytest.raises(Refusal) as silent:
        registry.open(STACKS, "other", [], now_ns=0, known_jobs={"other"})
    assert silent.value.code == "failed_precondition" and "never polled" in str(silent.value)
    assert registry.refused == 2


def test_ranks_that_stopped_polling_are_named_with_their_last_poll(
    registry: ControlRegistry,
) -> None:
    registry.poll(hello(0), now_ns=0)
    registry.poll(hello(1), now_ns=1 * S)
    registry.poll(hello(1, leaving=True), now_ns=2 * S)
    with pytest.raises(Refusal) as refused:
        registry.open(STACKS, "job", [], now_ns=12 * S)
    message = str(refused.value)
    assert refused.value.code == "failed_precondition"
    assert "rank 0 not polling (last polled 12.0s ago)" in message
    assert "rank 1 left (its run ended 10.0s ago)" in message


def test_orders_repeat_until_acknowledged_and_stop_once_answered(registry: ControlRegistry) -> None:
    registry.poll(hello(0), 0)
    registry.poll(hello(1), 0)
    request = registry.open(STACKS, "job", [0, 1, 7], now_ns=S)
    assert [o.state for o in request.excluded] == [UNKNOWN_RANK]
    assert [o.kind for o in registry.poll(hello(0), S)] == [STACKS]
    assert [o.kind for o in registry.poll(hello(0), S)] == [STACKS]  # not acknowledged: again
    assert registry.poll(hello(0, busy=(f"{request.request_id}:0",)), S) == []
    assert registry.deliver(Chunk(request.request_id, "job", 1, part="stacks.json", data=b"{}",
                                  last=True, total_bytes=2), S) == (True, "")  # fmt: skip
    assert registry.poll(hello(1), S) == []  # answered: nothing to repeat
    assert request.delivery(1).state == DELIVERED and not request.all_done()


def test_a_rank_that_goes_quiet_while_asked_is_given_up_before_the_deadline(
    registry: ControlRegistry,
) -> None:
    registry.poll(hello(0), 0)
    registry.poll(hello(1), 0)
    request = registry.open(STACKS, "job", [], now_ns=0)
    registry.deliver(Chunk(request.request_id, "job", 0, part="stacks.json", last=True), 0)
    now = [0]

    def clock() -> int:
        now[0] += S
        return now[0]

    done = registry.wait(request, lambda r: r.all_done(), deadline_ns=60 * S, clock=clock)
    assert done and now[0] < 60 * S
    outcomes = {o.rank: o for o in registry.close(request, now[0])}
    assert outcomes[0].state == DELIVERED
    assert outcomes[1].state == NOT_POLLING and "stopped polling while asked" in outcomes[1].detail


def test_a_request_that_times_out_names_the_ranks_and_cancels_them(
    registry: ControlRegistry,
) -> None:
    registry.poll(hello(0), 0)
    request = registry.open(STACKS, "job", [0], now_ns=0)
    assert not registry.wait(request, lambda r: r.all_done(), deadline_ns=S, clock=lambda: S)
    (outcome,) = registry.close(request, S)
    assert outcome.state == TIMED_OUT and "at step 0" in outcome.detail
    assert [o.kind for o in registry.poll(hello(0), S)] == ["cancel"]
    assert registry.poll(hello(0), S) == []  # a cancel is sent once


def test_a_profile_is_prepared_then_started_at_the_first_step_every_rank_will_reach(
    registry: ControlRegistry,
) -> None:
    # Rank 0 does 2 steps/s, rank 1 is one step behind at the same pace.
    for t in range(4):
        registry.poll(hello(0, step=10 + 2 * t), t * S)
        registry.poll(hello(1, step=9 + 2 * t), t * S)
    request = registry.open(PROFILE, "job", [], now_ns=3 * S, profile=ProfileSpec(steps=2))
    registry.poll(hello(0, step=16, ready=(request.request_id,)), 3 * S)
    assert request.delivery(0).state == "ready" and not request.all_ready()
    registry.poll(hello(1, step=15, ready=(request.request_id,)), 3 * S)
    assert request.all_ready()
    start = registry.start_profile(request, None, now_ns=3 * S)
    # Rank 0 at step 16, 2 steps/s, 2 s of lookahead: at most step 20 by then; start at 21.
    assert start == 21
    (order,) = [o for o in registry.poll(hello(0, step=16), 3 * S) if o.plan == 1]
    assert (order.start_step, order.profile) == (21, ProfileSpec(steps=2))


def test_a_miss_plans_again_further_ahead_and_drops_traces_of_the_old_plan(
    registry: ControlRegistry,
) -> None:
    for rank in (0, 1):
        registry.poll(hello(rank, step=5), 0)
    request = registry.open(PROFILE, "job", [], now_ns=0, profile=ProfileSpec(steps=1))
    for rank in (0, 1):
        registry.poll(hello(rank, step=5, ready=(request.request_id,)), 0)
    registry.start_profile(request, None, now_ns=0)
    first = request.start_step
    ok = Chunk(request.request_id, "job", 0, plan=1, part="trace.json.gz", data=b"x", last=True,
               total_bytes=1)  # fmt: skip
    assert registry.deliver(ok, 0) == (True, "")
    missed = Chunk(request.request_id, "job", 1, plan=1, error="already at step 40",
                   missed=True, first_step=40, last=True)  # fmt: skip
    assert registry.deliver(missed, 0) == (True, "")
    assert request.plan == 2 and request.start_step >= 41 > first
    assert request.delivery(0).state == "asked to start" and not request.delivery(0).parts
    accepted, reason = registry.deliver(ok, 0)  # a late chunk of plan 1
    assert not accepted and "replaced by plan 2" in reason


def test_a_prepare_that_does_not_finish_drops_the_slow_rank(registry: ControlRegistry) -> None:
    for rank in (0, 1):
        registry.poll(hello(rank), 0)
    request = registry.open(PROFILE, "job", [], now_ns=0, profile=ProfileSpec(steps=1))
    registry.poll(hello(0, ready=(request.request_id,)), 0)
    registry.start_profile(request, 50, now_ns=0)
    assert request.start_step == 50 and not request.planned_here
    assert request.delivery(1).state == NOT_READY
    assert [o.kind for o in registry.poll(hello(1), 0)] == ["cancel"]


def test_size_limits_per_rank_and_per_request(registry: ControlRegistry) -> None:
    for rank in (0, 1):
        registry.poll(hello(rank), 0)
    request = registry.open(STACKS, "job", [], now_ns=0)
    rid = request.request_id
    assert registry.deliver(Chunk(rid, "job", 0, index=0, part="stacks.json", data=b"a" * 90), 0)[0]
    accepted, reason = registry.deliver(
        Chunk(rid, "job", 0, index=1, part="stacks.json", data=b"a" * 20), 0
    )
    assert not accepted and request.delivery(0).state == OVER_LIMIT and "MiB" in reason
    assert not request.delivery(0).parts  # what came is let go
    out_of_order = registry.deliver(Chunk(rid, "job", 1, index=3, data=b"a"), 0)
    assert out_of_order == (False, "chunk 3 arrived, 0 expected")
    assert registry.rejected_chunks == 2


def test_a_delivery_shorter_than_announced_is_rejected(registry: ControlRegistry) -> None:
    registry.poll(hello(0), 0)
    request = registry.open(STACKS, "job", [], now_ns=0)
    first = Chunk(request.request_id, "job", 0, index=0, part="stacks.json", data=b"ab",
                  total_bytes=5)  # fmt: skip
    assert registry.deliver(first, 0) == (True, "")
    last = Chunk(request.request_id, "job", 0, index=1, part="stacks.json", data=b"c", last=True)
    assert registry.deliver(last, 0) == (False, "the delivery ended at 3 of 5 bytes")
    assert request.delivery(0).state == "rejected" and not request.delivery(0).parts


def test_one_capture_per_job_and_a_daemon_wide_limit(registry: ControlRegistry) -> None:
    for job in ("a", "b", "c"):
        registry.poll(hello(0, job=job), 0)
    registry.open(PROFILE, "a", [], now_ns=0, profile=ProfileSpec(steps=1))
    with pytest.raises(Refusal, match=r"a profile of job 'a' is already running \(profile-1"):
        registry.open(PROFILE, "a", [], now_ns=S, profile=ProfileSpec(steps=1))
    registry.open(PROFILE, "b", [], now_ns=0, profile=ProfileSpec(steps=1))
    with pytest.raises(Refusal, match="at most 2 at once") as refused:
        registry.open(PROFILE, "c", [], now_ns=0, profile=ProfileSpec(steps=1))
    assert refused.value.code == "resource_exhausted"
    registry.open(STACKS, "c", [], now_ns=0)  # stacks are not captures: never limited


def test_a_prepared_profile_nobody_collects_expires(registry: ControlRegistry) -> None:
    registry.poll(hello(0), 0)
    request = registry.open(PROFILE, "job", [], now_ns=0, profile=ProfileSpec(steps=1))
    registry.prepared(request, 0)
    ttl = int(registry.limits.prepared_ttl_seconds * S)
    registry.poll(hello(0), ttl + S)
    registry.open(PROFILE, "job", [], now_ns=ttl + S, profile=ProfileSpec(steps=1))
    assert request.closed and request.delivery(0).state == TIMED_OUT


def test_a_rank_leaving_mid_request_answers_for_itself_at_once(registry: ControlRegistry) -> None:
    registry.poll(hello(0), 0)
    request = registry.open(STACKS, "job", [], now_ns=0)
    waiter = threading.Thread(
        target=registry.wait,
        args=(request, lambda r: r.all_done()),
        kwargs={"deadline_ns": 10**20, "clock": lambda: 0},
    )
    waiter.start()
    registry.poll(hello(0, leaving=True), 0)
    waiter.join(timeout=30)
    assert not waiter.is_alive() and request.delivery(0).state == LEFT


def _view(step: int, rate: float, polled_ns: int) -> EndpointView:
    return EndpointView(hello=hello(0, step=step), last_poll_ns=polled_ns, steps_per_second=rate,
                        polling=True, left=False)  # fmt: skip


def test_planning_arithmetic() -> None:
    # A rank with no known rate starts at the next step; time since its poll counts.
    assert first_common_step([_view(7, 0.0, 0)], now_ns=0, lookahead_seconds=2) == 8
    assert first_common_step([_view(7, 1.0, 0)], now_ns=3 * S, lookahead_seconds=2) == 13
    assert (
        first_common_step([_view(7, 1.0, 0), _view(3, 0.5, 0)], now_ns=0, lookahead_seconds=2) == 10
    )
    # Seconds become steps at the slowest rank's pace; no pace known: 0 (time-based).
    assert steps_for_seconds(3.0, [_view(0, 10.0, 0), _view(0, 2.0, 0)]) == 6
    assert steps_for_seconds(3.0, [_view(0, 0.0, 0)]) == 0


def test_the_rate_is_the_fastest_recent_one(registry: ControlRegistry) -> None:
    for t, step in ((0, 0), (1, 1), (2, 5), (3, 6)):
        registry.poll(hello(0, step=step), t * S)
    (view,) = registry.endpoints("job", 3 * S)
    assert view.steps_per_second == pytest.approx(4.0)


def test_ranks_silent_for_an_hour_are_forgotten(registry: ControlRegistry) -> None:
    registry.poll(hello(0, job="old"), 0)
    hour = int(FORGET_AFTER_SECONDS * S)
    registry.poll(hello(0, job="new"), hour + S)  # a new rank registering sweeps the old
    assert [v.hello.job_id for v in registry.endpoints("", hour + S)] == ["new"]


def test_a_rank_reporting_absurd_steps_gets_a_start_it_never_reaches(
    registry: ControlRegistry,
) -> None:
    registry.poll(hello(0, step=0), 0)
    registry.poll(hello(0, step=MAX_STEP), S)  # "rate": 2**63 steps per second
    request = registry.open(PROFILE, "job", [], now_ns=S, profile=ProfileSpec(steps=1))
    registry.poll(hello(0, step=MAX_STEP, ready=(request.request_id,)), S)
    assert registry.start_profile(request, None, now_ns=S) == MAX_STEP  # fits int64 on the wire
