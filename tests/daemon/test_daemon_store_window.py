"""A rank's window: figures kept per step follow every span that arrives, and stay bounded."""

from __future__ import annotations

import pytest

from plait.daemon import telemetry_schema as names
from plait.daemon.bottleneck import StepSpan, step_breakdown
from plait.daemon.decoder import RankIdentity, SpanRecord, decode_span
from plait.daemon.store import RankWindow, union_seconds

MS = 1_000_000
BASE = 1_700_000_000 * 10**9


def identity() -> RankIdentity:
    return RankIdentity(
        job_id="job", rank=0, local_rank=0, world_size=1, host="h", pid=1, device="cpu",
        device_name="cpu", compute_dtype="float32", peak_flops=1e12, peak_flops_source="test",
        model_name="m", num_params=1, coordinates={}, degrees={},
    )  # fmt: skip


def step_span(step: int, start: int, end: int) -> SpanRecord:
    attributes = {names.SPAN_STEP: step, names.SPAN_STEP_MODEL_FLOPS: 1e9}
    return decode_span(names.STEP_SPAN_NAME, BASE + start * MS, BASE + end * MS, attributes)


def phase(step: int, name: str, start: int, end: int) -> SpanRecord:
    attributes = {names.SPAN_STEP: step, names.SPAN_PHASE: name}
    return decode_span(name, BASE + start * MS, BASE + end * MS, attributes)


def comm(step: int, start: int, end: int, *, blocking: bool = False) -> SpanRecord:
    attributes = {
        names.SPAN_STEP: step,
        names.SPAN_COMM_OP: "all_reduce",
        names.SPAN_COMM_PURPOSE: "grad_bucket",
        names.SPAN_COMM_ASYNC: not blocking,
        names.SPAN_COMM_BYTES: 1 << 20,
    }
    return decode_span("all_reduce", BASE + start * MS, BASE + end * MS, attributes)


def expected(window: RankWindow, step: int) -> tuple[float, float]:
    """The step's exposed communication and comm time, computed from scratch."""
    record = window.steps[step]
    spans: list[StepSpan] = window.step_spans.get(step, [])
    fresh = step_breakdown(step, record.start_ns, record.end_ns, spans)
    comm_time = union_seconds((s.start_ns, s.end_ns) for s in spans if s.kind == "comm")
    return fresh.seconds["exposed_comm"], comm_time


def test_figures_follow_spans_that_arrive_after_the_step_was_analysed() -> None:
    window = RankWindow(identity(), window_steps=8, window_spans=1000)
    for span in (step_span(0, 0, 100), phase(0, "forward", 0, 40), phase(0, "backward", 40, 80)):
        window.add_span(span)
    first = window.breakdowns(0)[0]
    assert window.breakdowns(0)[0] is first  # nothing new: not computed again
    assert first.seconds["exposed_comm"] == 0.0 and window.comm_seconds(0) == 0.0

    window.add_span(comm(0, 70, 90))  # a late bucket: 10 ms past the backward
    again = window.breakdowns(0)[0]
    assert again.seconds["exposed_comm"] == pytest.approx(0.010)
    assert (again.seconds["exposed_comm"], window.comm_seconds(0)) == pytest.approx(
        expected(window, 0)
    )
    assert window.comm_seconds(0) == pytest.approx(0.020)

    window.add_span(step_span(0, 0, 85))  # the step span sent again, with other bounds
    clipped = window.breakdowns(0)[0]
    assert clipped.step_seconds == pytest.approx(0.085)
    assert clipped.seconds["exposed_comm"] == pytest.approx(0.005)


def test_comm_time_of_a_step_without_a_step_span_yet() -> None:
    window = RankWindow(identity(), window_steps=8, window_spans=1000)
    window.add_span(comm(3, 0, 10))
    assert window.comm_seconds(3) == pytest.approx(0.010)
    window.add_span(comm(3, 5, 30))
    assert window.comm_seconds(3) == pytest.approx(0.030)
    window.add_span(step_span(3, 0, 40))
    assert window.breakdowns(0)[0].comm_seconds == pytest.approx(0.030)


def test_a_producer_sending_the_same_steps_again_and_again_stays_bounded() -> None:
    """Retried exports or a replaying producer repeat step numbers: the spans indexed by step
    stay within `window_spans` however often a step comes back, and the figures stay right."""
    window = RankWindow(identity(), window_steps=8, window_spans=120)
    for _ in range(50):
        for step in range(4):
            base = step * 100
            window.add_span(step_span(step, base, base + 100))
            window.add_span(phase(step, "forward", base, base + 40))
            window.add_span(phase(step, "backward", base + 40, base + 80))
            window.add_span(comm(step, base + 70, base + 90))
    kept = sum(len(spans) for spans in window.step_spans.values())
    assert kept == window.step_spans_kept <= 120
    assert max(len(spans) for spans in window.step_spans.values()) <= 120
    for record in window.last_steps(0):
        exposed, comm_time = expected(window, record.step)
        assert window.breakdown(record).seconds["exposed_comm"] == pytest.approx(exposed)
        assert window.comm_seconds(record.step) == pytest.approx(comm_time)
        assert exposed == pytest.approx(0.010)


def test_trimmed_steps_leave_nothing_behind() -> None:
    window = RankWindow(identity(), window_steps=4, window_spans=1000)
    for step in range(40):
        base = step * 100
        window.add_span(step_span(step, base, base + 100))
        window.add_span(comm(step, base + 10, base + 20))
        window.breakdowns(0)  # analysed while the window moves on
    assert len(window.steps) == 4
    assert len(window.step_spans) <= 8
    assert set(window._analysed) <= set(window.step_spans) | set(window.steps)


@pytest.mark.parametrize("count", [0, 1, 5, 12, 13, 50])
def test_last_steps_are_the_newest_oldest_first(count: int) -> None:
    window = RankWindow(identity(), window_steps=12, window_spans=1000)
    for step in range(20):  # the first 8 fall out of the window of 12
        window.add_span(step_span(step, step * 10, step * 10 + 9))
    window.add_span(step_span(11, 110, 118))  # sent again: it becomes the newest
    order = [*range(8, 11), *range(12, 20), 11]
    wanted = order if count == 0 else order[-count:]
    assert [r.step for r in window.last_steps(count)] == wanted
    assert [s.step for s in window.samples(count)] == wanted
