"""The rank's profiler on its own: prepared off the training thread, started and stopped on step
boundaries, a miss reported instead of other steps recorded, cancelled or oversized captures
never delivered as traces, and a run that ends mid-capture still delivers what it recorded."""

from __future__ import annotations

import gzip
import json
import threading

import pytest
import torch

from plait.plugins.telemetry.profile_capture import ProfileCapture, ProfilePlan, ProfileResult


class Delivered:
    def __init__(self) -> None:
        self.results: list[ProfileResult] = []
        self.arrived = threading.Event()

    def __call__(self, result: ProfileResult) -> None:
        self.results.append(result)
        self.arrived.set()

    def one(self) -> ProfileResult:
        assert self.arrived.wait(60), "nothing was delivered"
        (result,) = self.results
        return result


def plan(start: int, steps: int = 2, max_bytes: int = 64 * 2**20, number: int = 1) -> ProfilePlan:
    return ProfilePlan("profile-1", number, start, steps, 0.0, max_bytes=max_bytes)


def prepared(capture: ProfileCapture) -> None:
    capture.prepare("profile-1", with_stack=False, record_shapes=True)
    for _ in range(600):
        if capture.ready() == ["profile-1"]:
            return
        threading.Event().wait(0.1)
    raise AssertionError("the profiler was never ready")


def run_steps(capture: ProfileCapture, steps: range) -> None:
    layer = torch.nn.Linear(16, 16)
    for step in steps:
        capture.step_started(step)
        layer(torch.randn(4, 16)).sum().backward()
        capture.step_finished(step)


def test_the_asked_steps_are_recorded_and_delivered_compressed() -> None:
    delivered = Delivered()
    capture = ProfileCapture(device="cpu", deliver=delivered)
    prepared(capture)
    assert "profile-1:0" in capture.busy()
    capture.arm(plan(start=3), current_step=1)
    run_steps(capture, range(1, 8))
    result = delivered.one()
    assert (result.error, result.first_step, result.last_step) == ("", 3, 4)
    document = json.loads(gzip.decompress(result.trace_gz))
    names = {e["name"] for e in document["traceEvents"] if e.get("ph") == "X"}
    assert {"ProfilerStep#3", "ProfilerStep#4"} <= names and "ProfilerStep#5" not in names
    assert any(e.get("args", {}).get("Input Dims") for e in document["traceEvents"])  # shapes
    assert capture.recording is None and capture.plan is None


def test_a_rank_past_the_start_step_reports_a_miss_at_once() -> None:
    delivered = Delivered()
    capture = ProfileCapture(device="cpu", deliver=delivered)
    capture.arm(plan(start=3), current_step=9)
    result = delivered.one()
    assert result.missed and result.first_step == 9 and not result.trace_gz
    assert "already at step 9" in result.error and capture.plan is None


def test_a_start_step_the_training_thread_skipped_is_a_miss_too() -> None:
    delivered = Delivered()
    capture = ProfileCapture(device="cpu", deliver=delivered)
    prepared(capture)
    capture.arm(plan(start=3), current_step=3)  # at the start step: undecided until the next
    run_steps(capture, range(4, 5))
    result = delivered.one()
    assert result.missed and result.first_step == 4


def test_a_trace_over_the_limit_is_not_sent_and_says_why() -> None:
    delivered = Delivered()
    capture = ProfileCapture(device="cpu", deliver=delivered)
    prepared(capture)
    capture.arm(plan(start=0, steps=1, max_bytes=100), current_step=-1)
    run_steps(capture, range(0, 2))
    result = delivered.one()
    assert not result.trace_gz and "over the daemon's" in result.error


def test_a_cancelled_recording_stops_and_is_dropped() -> None:
    delivered = Delivered()
    capture = ProfileCapture(device="cpu", deliver=delivered)
    prepared(capture)
    capture.arm(plan(start=0, steps=5), current_step=-1)
    run_steps(capture, range(0, 2))
    assert capture.recording is not None
    capture.cancel("profile-1")
    run_steps(capture, range(2, 3))
    assert capture.recording is None and delivered.results == []


def test_a_replaced_plan_drops_the_old_recording_and_records_the_new_one() -> None:
    delivered = Delivered()
    capture = ProfileCapture(device="cpu", deliver=delivered)
    prepared(capture)
    capture.arm(plan(start=0, steps=3), current_step=-1)
    run_steps(capture, range(0, 1))
    capture.arm(plan(start=4, steps=1, number=2), current_step=0)  # another rank missed step 0
    run_steps(capture, range(1, 6))
    result = delivered.one()
    assert (result.plan.plan, result.first_step, result.last_step) == (2, 4, 4)


@pytest.mark.parametrize("recorded", [1, 0])
def test_a_run_that_ends_mid_capture_delivers_what_it_holds(recorded: int) -> None:
    delivered = Delivered()
    capture = ProfileCapture(device="cpu", deliver=delivered)
    prepared(capture)
    capture.arm(plan(start=0, steps=10), current_step=-1)
    run_steps(capture, range(0, recorded))
    if not recorded:  # started, not finished: nothing worth sending
        capture.step_started(0)
    capture.stop()
    if recorded:
        result = delivered.one()
        assert (result.first_step, result.last_step) == (0, 0) and result.trace_gz
    else:
        assert delivered.results == []


def test_the_end_of_a_run_waits_for_a_trace_still_being_delivered() -> None:
    gate, delivered = threading.Event(), Delivered()

    def slow(result: ProfileResult) -> None:
        gate.wait(60)  # a daemon slow to take the trace
        delivered(result)

    capture = ProfileCapture(device="cpu", deliver=slow)
    prepared(capture)
    capture.arm(plan(start=0, steps=1), current_step=-1)
    run_steps(capture, range(0, 2))  # the capture ended with step 0; its export is under way
    ending = threading.Thread(target=capture.stop)
    ending.start()
    ending.join(0.2)
    assert ending.is_alive() and delivered.results == []
    gate.set()
    ending.join(60)
    assert not ending.is_alive() and delivered.one().last_step == 0


def test_the_clock_offset_comes_from_the_shortest_round_trip() -> None:
    from plait.plugins.telemetry.control_client import ClockEstimate

    clock = ClockEstimate(samples=3)
    assert clock.best == (0, 0)
    # The daemon is 5 ms ahead. A slow reply (10 ms round trip, the daemon stamping early in it)
    # suggests +1 ms; a fast one (200 µs) +5 ms, within half its trip.
    clock.add(sent_ns=1_000_000_000, daemon_ns=1_006_000_000, received_ns=1_010_000_000)
    clock.add(sent_ns=2_000_000_000, daemon_ns=2_005_050_000, received_ns=2_000_200_000)
    offset, rtt = clock.best
    assert rtt == 200_000 and abs(offset - 5_000_000) <= rtt // 2
    for i in range(3):  # older samples fall out of the window
        clock.add(sent_ns=3_000_000_000 + i, daemon_ns=3_000_500_000, received_ns=3_001_000_000 + i)
    assert clock.best[1] == 1_000_000
