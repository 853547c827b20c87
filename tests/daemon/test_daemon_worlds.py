"""Worlds, restarts, stale ranks and job states, driven by real OTLP exports from processes.

Two rank producers (`world_producers.produce`, plait's telemetry plugin in a process each) play
a 2-node job; killing one plays a lost node, and a new producer with world size 1 and restart
attempt 1 plays torchrun's restart of the survivor.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from rich.console import Console
from typer.testing import CliRunner

from plait.daemon import mfu
from plait.daemon.config import DaemonConfig
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from plait.tools import daemon_commands
from tests.daemon.otlp_inputs import rank_resource, step_spans, trace_request
from tests.daemon.world_producers import produce

STALE_FLOOR = 6.0  # seconds; a live producer is heard from every ~0.2 s (heartbeats)
# Busy seconds of each 0.1 s step on rank 0 and rank 1: the job's step time is the slower's.
FAST, SLOW = 0.04, 0.08
FOREVER = 100_000  # steps: the producer runs until killed


@pytest.fixture
def server() -> Iterator[DaemonServer]:
    config = DaemonConfig(bind="127.0.0.1:0", host_interval=0.5, stale_floor=STALE_FLOOR)
    with DaemonServer(config=config) as daemon:
        yield daemon


@pytest.fixture
def stub(server: DaemonServer) -> Iterator[daemon_pb2_grpc.DaemonStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield daemon_pb2_grpc.DaemonStub(channel)


@pytest.fixture
def spawn() -> Iterator[Callable[..., multiprocessing.process.BaseProcess]]:
    context = multiprocessing.get_context("spawn")
    started: list[multiprocessing.process.BaseProcess] = []

    def start(*args: Any) -> multiprocessing.process.BaseProcess:
        process = context.Process(target=produce, args=args, daemon=True)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(timeout=10)


def wait_for(
    stub: daemon_pb2_grpc.DaemonStub,
    ready: Callable[[daemon_pb2.GetMetricsResponse], bool],
    timeout: float,
    *,
    include_finished: bool = False,
) -> tuple[daemon_pb2.GetMetricsResponse, float]:
    """The first metrics answer `ready` accepts, and how long it took; fails after `timeout`."""
    start = time.monotonic()
    request = daemon_pb2.GetMetricsRequest(window_steps=10, include_finished=include_finished)
    while True:
        response = stub.GetMetrics(request, timeout=10)
        if ready(response):
            return response, time.monotonic() - start
        assert time.monotonic() - start < timeout, f"not ready after {timeout} s: {response}"
        time.sleep(0.1)


def job(response: daemon_pb2.GetMetricsResponse, job_id: str) -> Any:
    found = [j for j in response.jobs if j.job_id == job_id]
    return found[0] if found else None


def rank(response: daemon_pb2.GetMetricsResponse, job_id: str, number: int) -> Any:
    found = [r for r in response.ranks if r.job_id == job_id and r.rank == number]
    return found[0] if found else None


@pytest.mark.timeout(180)
def test_a_lost_node_goes_stale_and_the_restarted_world_replaces_it(
    server: DaemonServer,
    stub: daemon_pb2_grpc.DaemonStub,
    spawn: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job_id = "elastic"
    epoch = time.time()
    survivor = spawn(server.address, job_id, 0, 2, 0, 0, FOREVER, FAST, epoch)
    lost = spawn(server.address, job_id, 1, 2, 0, 0, FOREVER, SLOW, epoch)

    def both_running(r: daemon_pb2.GetMetricsResponse) -> bool:
        j = job(r, job_id)
        return bool(j) and j.ranks_reporting == 2 and j.window_steps >= 5 and j.state == "running"

    before, _ = wait_for(stub, both_running, timeout=90)
    assert job(before, job_id).world_size == 2 and job(before, job_id).restarts == 0

    lost.kill()  # the node is gone: no end-of-run span, no more exports
    lost.join(timeout=10)

    def lost_is_stale(r: daemon_pb2.GetMetricsResponse) -> bool:
        dead, alive = rank(r, job_id, 1), rank(r, job_id, 0)
        # (On a loaded machine the survivor's exports may lag for a moment: wait it out.)
        return bool(dead and alive) and (dead.status, alive.status) == ("stale", "live")

    stale, waited = wait_for(stub, lost_is_stale, timeout=STALE_FLOOR + 10)
    print(f"rank 1 stale {waited:.2f} s after its producer was killed (floor {STALE_FLOOR} s)")
    # Stale within its threshold (the floor: 3 × its step is below it) plus export slack.
    assert waited <= STALE_FLOOR + 5
    j, live = job(stale, job_id), rank(stale, job_id, 0)
    assert (j.state, j.ranks_reporting, j.ranks_stale, j.world_size) == ("running", 1, 1, 2)
    assert live.status == "live"
    # The job's MFU is the survivor's alone: with the slow stale rank counted, every step would
    # last as long as its 0.08 s (and only the steps before its death would be common).
    assert not mfu.is_calibration_error(j.mfu) and j.mfu > 0
    assert j.mfu == pytest.approx(live.mfu, rel=1e-6)
    assert j.step_seconds == pytest.approx(live.step_seconds, rel=1e-6)
    assert j.step_seconds < (FAST + SLOW) / 2

    # torchrun restarts the survivor's worker as world 1 (attempt 1), resuming at step 40.
    survivor.kill()
    survivor.join(timeout=10)
    spawn(server.address, job_id, 0, 1, 1, 40, FOREVER, FAST)

    def restarted(r: daemon_pb2.GetMetricsResponse) -> bool:
        j = job(r, job_id)
        return bool(j) and j.world_size == 1 and j.window_steps >= 3

    after, _ = wait_for(stub, restarted, timeout=90)
    j, new = job(after, job_id), rank(after, job_id, 0)
    assert (j.state, j.ranks_reporting, j.world_size, j.ranks_stale) == ("running", 1, 1, 0)
    assert list(j.world_sizes) == [2, 1] and j.restarts == 1
    assert j.world_started_step == 41  # step 40 on the wire is the trainer's step 41
    assert new.restart_attempt == 1 and new.step >= 43
    assert rank(after, job_id, 1) is None  # the old world's rank is superseded, not listed
    assert j.mfu == pytest.approx(new.mfu, rel=1e-6)
    listed = stub.ListRanks(daemon_pb2.ListRanksRequest(job_id=job_id), timeout=10).ranks
    assert sorted((r.rank, r.world_size, r.status) for r in listed) == [
        (0, 1, "live"),
        (1, 2, "superseded"),
    ]
    everything = stub.GetMetrics(
        daemon_pb2.GetMetricsRequest(window_steps=10, include_finished=True), timeout=10
    )
    assert rank(everything, job_id, 1).status == "superseded"

    # What an operator reads: 1/1 ranks, worlds 2 → 1, one restart, since step 41.
    monkeypatch.setattr(daemon_commands, "console", Console(width=200))
    shown = CliRunner().invoke(daemon_commands.app, ["top", "--once", "--host", server.address])
    assert shown.exit_code == 0, shown.output
    (row,) = [line for line in shown.output.splitlines() if "│ elastic" in line][:1]
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    assert cells[:6] == ["elastic", "1/1", "running", "2 → 1", "1", "41"]
    print(shown.output)


@pytest.mark.timeout(120)
def test_finished_jobs_are_hidden_and_killed_ones_go_stale(
    server: DaemonServer, stub: daemon_pb2_grpc.DaemonStub, spawn: Callable[..., Any]
) -> None:
    done = spawn(server.address, "done", 0, 1, 0, 0, 5, FAST)  # ends after 5 steps
    killed = spawn(server.address, "killed", 0, 1, 0, 0, FOREVER, FAST)
    wait_for(stub, lambda r: bool(job(r, "killed")) and job(r, "killed").window_steps >= 3, 90)
    done.join(timeout=60)
    assert done.exitcode == 0
    killed.kill()
    killed.join(timeout=10)

    def settled(r: daemon_pb2.GetMetricsResponse) -> bool:
        return bool(job(r, "killed")) and job(r, "killed").state == "stale"

    shown, _ = wait_for(stub, settled, timeout=STALE_FLOOR + 10)
    assert job(shown, "done") is None  # finished: hidden by default
    everything = stub.GetMetrics(
        daemon_pb2.GetMetricsRequest(window_steps=10, include_finished=True), timeout=10
    )
    finished = job(everything, "done")
    assert (finished.state, finished.window_steps, finished.ranks_reporting) == ("finished", 5, 1)
    named = stub.GetMetrics(daemon_pb2.GetMetricsRequest(job_id="done"), timeout=10)
    assert job(named, "done").state == "finished"  # asked for by name: shown
    status = stub.Status(daemon_pb2.StatusRequest(), timeout=10)
    assert dict(status.job_states) == {"done": "finished", "killed": "stale"}
    assert status.stale_floor_seconds == STALE_FLOOR
    bottleneck = stub.GetBottleneck(daemon_pb2.GetBottleneckRequest(), timeout=10)
    assert {b.job_id for b in bottleneck.ranks} == set()  # stale ranks are not analysed
    all_ranks = stub.GetBottleneck(
        daemon_pb2.GetBottleneckRequest(include_finished=True), timeout=10
    )
    assert {b.job_id for b in all_ranks.ranks} == {"done"}


def send(server: DaemonServer, resource: dict[str, Any], spans: list[Any]) -> None:
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        response = stub.Export(trace_request(resource, spans), timeout=10)
        assert not response.HasField("partial_success"), response


def end_span(outcome: str, step: int) -> Any:
    from plait.daemon import telemetry_schema as schema
    from tests.daemon.otlp_inputs import SpanSpec

    now = time.time_ns()
    attributes = {schema.SPAN_JOB_OUTCOME: outcome, schema.SPAN_STEP: step}
    return SpanSpec(schema.JOB_END_SPAN_NAME, now, now, attributes)


def test_a_rank_that_says_it_failed_fails_the_job_and_a_bad_outcome_is_rejected(
    server: DaemonServer, stub: daemon_pb2_grpc.DaemonStub
) -> None:
    base = time.time_ns() - 10**9
    for number in (0, 1):
        send(server, rank_resource("job", number), step_spans(0, 3, base))
    send(server, rank_resource("job", 0), [end_span("finished", 2)])
    status = stub.Status(daemon_pb2.StatusRequest(), timeout=10)
    assert dict(status.job_states) == {"job": "running"}  # rank 1 has not ended
    send(server, rank_resource("job", 1), [end_span("failed", 2)])
    status = stub.Status(daemon_pb2.StatusRequest(), timeout=10)
    assert dict(status.job_states) == {"job": "failed"}
    shown = stub.GetMetrics(daemon_pb2.GetMetricsRequest(), timeout=10)
    assert job(shown, "job").state == "failed"  # failed jobs stay in view
    assert {r.status for r in shown.ranks} == {"ended"}

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        traces = trace_service_pb2_grpc.TraceServiceStub(channel)
        bad = trace_request(rank_resource("job", 0), [end_span("crashed", 2)])
        response = traces.Export(bad, timeout=10)
    assert response.partial_success.rejected_spans == 1
    assert "plait.job.outcome" in response.partial_success.error_message
    assert "finished, failed" in response.partial_success.error_message


def test_a_daemon_config_names_the_setting_it_refuses() -> None:
    with pytest.raises(ValueError, match="stale_floor must be > 0"):
        DaemonConfig(stale_floor=0)
    with pytest.raises(ValueError, match=r"stale_ceiling \(10\) must be >= stale_floor"):
        DaemonConfig(stale_floor=30, stale_ceiling=10)
    with pytest.raises(TypeError, match="stale_flor"):
        DaemonServer("127.0.0.1:0", stale_flor=3)  # type: ignore[arg-type]
