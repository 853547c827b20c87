"""Real 2-rank runs against a daemon: a stalled collective, a slow data loader, a slow rank."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from plait.testing.distributed import run_distributed
from tests.daemon.analysis_workers import (
    HANG_JOB_ID,
    SLOW_JOB_ID,
    bucket_finishing_under_compute,
    stall_before_all_reduce,
    train_slow_loader_and_rank,
)
from tests.daemon.otlp_sink import OtlpSink

engine_available = importlib.util.find_spec("plait.core.engine") is not None
STALL_SEQ = 2
DATA_SECONDS, SLOW_FORWARD = 1.0, 0.3
CLASS_FIELDS = (
    "compute",
    "exposed_comm",
    "data_wait",
    "pipeline_bubble",
    "optimizer",
    "host_other",
)


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_stalled_rank_is_reported_as_missing_from_the_collective(tmp_path: Path) -> None:
    # Rank 1 stays out of the collective until the hang has been reported (to the CLI's RPC
    # and upstream), then joins it: every step waits for what the daemon did, not a clock.
    release = tmp_path / "release"
    with OtlpSink() as sink:
        server = DaemonServer(
            "127.0.0.1:0", host_interval=0.5, hang_timeout=1.0, otlp_endpoint=sink.endpoint
        ).start()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["results"] = run_distributed(
                    stall_before_all_reduce, 2, server.address, STALL_SEQ, str(release), 3,
                    timeout=180, env={"PLAIT_HEARTBEAT_INTERVAL_MS": "200"},
                )  # fmt: skip
            except BaseException as exc:
                outcome["error"] = exc

        ranks = threading.Thread(target=run)
        ranks.start()
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = daemon_pb2_grpc.DaemonStub(channel)

                def stalled_hang() -> Any:
                    hangs = stub.Status(daemon_pb2.StatusRequest(), timeout=5).hangs
                    assert all(h.seq == STALL_SEQ for h in hangs), hangs
                    return next((h for h in hangs if h.seq == STALL_SEQ), None)

                def cleared() -> Any:
                    status = stub.Status(daemon_pb2.StatusRequest(), timeout=5)
                    return status if not status.hangs else None

                hang = poll(stalled_hang, ranks.is_alive)
                reported_upstream = sink.wait_for(
                    lambda s: any(span.name == "plait.collective.hang" for _, span in s.spans),
                    timeout=60,
                )
                release.touch()
                ranks.join(timeout=200)
                after = poll(cleared)
            assert "error" not in outcome, outcome.get("error")
            assert hang is not None, "no hang reported while rank 1 stalled"
            assert (hang.job_id, hang.group, hang.op, hang.seq) == (
                HANG_JOB_ID, "world", "all_reduce", STALL_SEQ,
            )  # fmt: skip
            assert list(hang.missing_ranks) == [1] and list(hang.entered_ranks) == [0]
            assert list(hang.unreported_ranks) == [] and hang.waiting_seconds >= 1.0
            assert hang.purpose == "grad_bucket"
            assert after is not None and list(after.hangs) == []  # cleared once it completed
            # The collective still computed the right sums once rank 1 arrived.
            assert outcome["results"][0] == [1.0, 3.0, 5.0]
            # ... and the hang went upstream as an OpenTelemetry span event.
            assert reported_upstream, "the hang never reached the upstream collector"
            (event_span,) = [span for _, span in sink.spans if span.name == "plait.collective.hang"]
            (event,) = event_span.events
            attributes = {kv.key: kv.value for kv in event.attributes}
            assert event.name == "hang.detected"
            assert attributes["plait.comm.seq"].int_value == STALL_SEQ
            assert [
                v.int_value for v in attributes["plait.hang.missing_ranks"].array_value.values
            ] == [1]
        finally:
            release.touch()  # never leave rank 1 waiting
            server.stop(grace=0.5)


def poll(
    answer: Callable[[], Any], go_on: Callable[[], bool] = lambda: True, timeout: float = 120
) -> Any:
    """The first non-None `answer()`, asked while `go_on()` holds; None when it stops holding
    or after `timeout` (a bound for a broken run, never reached by a working one)."""
    deadline = time.monotonic() + timeout
    while go_on() and time.monotonic() < deadline:
        found = answer()
        if found is not None:
            return found
        time.sleep(0.05)
    return None


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.skipif(not engine_available, reason="the training engine is absent")
def test_slow_loader_is_data_bound_and_slow_rank_is_flagged(daemon_server, daemon_stub) -> None:
    # Real clocks measure these steps, so the induced costs dwarf what a busy machine adds:
    # each batch arrives DATA_SECONDS late, rank 1's two forwards take SLOW_FORWARD longer.
    run_distributed(
        train_slow_loader_and_rank, 2, daemon_server.address, 4, DATA_SECONDS, 1, SLOW_FORWARD,
        timeout=150,
    )  # fmt: skip
    response = daemon_stub.GetBottleneck(
        daemon_pb2.GetBottleneckRequest(job_id=SLOW_JOB_ID, window_steps=3)
    )
    by_rank = {r.rank: r for r in response.ranks}
    assert sorted(by_rank) == [0, 1]
    for rank in by_rank.values():
        assert rank.steps == 3  # the first step (warm-up) is outside the window
        assert rank.dominant == "data", rank
        # At least the loader's delay (a sleep never ends early), and not the step's compute.
        assert DATA_SECONDS <= rank.data_wait_seconds < DATA_SECONDS + 0.5, rank
        parts = sum(getattr(rank, f"{name}_seconds") for name in CLASS_FIELDS)
        assert parts == pytest.approx(rank.step_seconds, rel=1e-6)
    assert response.dominant == "data" and "data-bound" in response.advice
    # Rank 1 spends 2 x SLOW_FORWARD more in forward per step: its compute stands out, and
    # rank 0 waits for it in the gradient all-reduce.
    assert by_rank[1].compute_seconds > by_rank[0].compute_seconds + SLOW_FORWARD
    assert by_rank[0].exposed_comm_seconds > by_rank[1].exposed_comm_seconds
    flagged = {s.rank: s for s in response.stragglers}
    assert flagged[1].flagged and not flagged[0].flagged
    assert flagged[1].compute_score > 0.2 > flagged[0].compute_score


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_bucket_that_finished_under_backward_is_not_timed_to_its_wait(daemon_server) -> None:
    # Real Gloo work handles. The first bucket completed before the second was issued, and is
    # waited on `compute` later: ended at the next issue it reads at most the time to that
    # issue; stamped at its wait it would read at least `compute` more.
    compute = 0.5
    for result in run_distributed(
        bucket_finishing_under_compute, 2, daemon_server.address, compute, timeout=90
    ):
        assert 0 < result["first_seconds"] <= result["second_issued_after"], result
