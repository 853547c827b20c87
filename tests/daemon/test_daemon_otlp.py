"""The telemetry plugin exporting over real OTLP/gRPC to a daemon on loopback."""

from __future__ import annotations

import logging
import os
import time

import pytest

from plait.core.config import load_config
from plait.daemon import telemetry_schema as names
from plait.daemon.client_auth import CONNECT_TIMEOUT_SECONDS, daemon_reachable
from plait.daemon.server import DaemonServer
from plait.plugins.telemetry import make_plugin, rank_telemetry
from plait.plugins.telemetry.rank_telemetry import RankTelemetry
from plait.proto.plait.v1 import daemon_pb2
from tests.daemon.daemon_fakes import (
    MODEL_FLOPS,
    PHASES,
    TOKENS,
    FakeBackend,
    job_info,
    run_fake_rank,
    synthetic_report,
)


def test_spans_metrics_and_mfu_reach_the_daemon(daemon_server: DaemonServer, daemon_stub) -> None:
    backend = FakeBackend()
    run_fake_rank(daemon_server.address, rank=0, steps=4, backend=backend)

    (info,) = daemon_stub.ListRanks(daemon_pb2.ListRanksRequest()).ranks
    assert (info.job_id, info.rank, info.world_size, info.pid) == ("job-a", 0, 2, os.getpid())
    assert info.peak_flops > 0 and info.peak_flops_source.startswith("cpu-calibration")
    assert dict(info.coordinates) == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert info.steps_received == 4

    # The fake rank has finished its run: finished jobs are shown when asked for.
    request = daemon_pb2.GetMetricsRequest(window_steps=10, include_finished=True)
    metrics = daemon_stub.GetMetrics(request)
    (rank,) = metrics.ranks
    assert rank.step == 4 and rank.window_steps == 4  # steps completed, as the trainer counts
    assert rank.step_seconds == pytest.approx(0.5)
    # this rank's share (1/world) of the job's FLOPs and tokens, over 0.5 s steps
    achieved = MODEL_FLOPS / 2 / 0.5
    assert rank.model_flops_per_second == pytest.approx(achieved)
    assert 0 < rank.mfu == pytest.approx(achieved / info.peak_flops)
    assert rank.tokens_per_second == pytest.approx(TOKENS / 2 / 0.5)
    assert rank.data_wait_seconds == pytest.approx(0.1)
    assert rank.loss == pytest.approx(1.7)
    assert 0 < rank.comm_share < 1
    assert rank.memory_rss_bytes == -1  # "testhost" is not this host: no process to sample
    assert rank.otel_metrics["plait.job.tokens"] == 4 * TOKENS
    assert rank.otel_metrics["plait.job.model_flops"] == pytest.approx(4 * MODEL_FLOPS)
    assert rank.otel_metrics["plait.step.duration.count"] == 4
    assert rank.otel_metrics["plait.step.duration.mean"] == pytest.approx(0.5)
    (job,) = metrics.jobs
    assert job.ranks_reporting == 1 and job.mfu == pytest.approx(rank.mfu)

    spans = [
        s for _, s in daemon_server.store.spans_in(job_id="", ranks=(), start_ns=0, end_ns=None)
    ]
    steps = [s for s in spans if s.kind == "step"]
    phases = [s for s in spans if s.kind == "phase"]
    comms = [s for s in spans if s.kind == "comm"]
    assert [s.step for s in steps] == [0, 1, 2, 3]
    assert len(phases) == 4 * len(PHASES) and len(comms) == 4 * 3
    first_report = synthetic_report(0, steps[0].start_ns)
    assert [(p.name, p.start_ns, p.end_ns) for p in phases[: len(PHASES)]] == [
        (p.name, p.start_ns, p.end_ns) for p in first_report.spans
    ]
    by_seq = {
        (c.attributes[names.SPAN_COMM_OP], c.attributes[names.SPAN_COMM_SEQ]): c for c in comms
    }
    sync = by_seq[("all_reduce", 0)].attributes
    assert sync[names.SPAN_COMM_BYTES] == 16 and sync[names.SPAN_COMM_DTYPE] == "float32"
    assert sync[names.SPAN_COMM_GROUP] == "dp" and sync[names.SPAN_COMM_GROUP_RANKS] == [0, 1]
    assert sync[names.SPAN_COMM_PURPOSE] == "metrics" and sync[names.SPAN_STEP] == 0
    send = by_seq[("send", 2)]
    assert send.attributes[names.SPAN_COMM_DTYPE] == "bfloat16"
    assert send.attributes[names.SPAN_COMM_PEER] == 1
    assert send.seconds >= 0.02  # ended at wait(), which took 20 ms: no future for send
    bucket = by_seq[("all_reduce", 1)]
    assert bucket.attributes[names.SPAN_COMM_ASYNC] is True
    # the async op ends when it is waited on, after the send's wait
    assert bucket.end_ns >= send.end_ns
    assert len(backend.requests) == 12


def test_unreachable_daemon_warns_once_and_is_quick(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Quick by construction, not by a stopwatch: the rank pays one bounded connection probe,
    # then holds no exporter, so no later step or the end of the run touches the network.
    probes: list[tuple[str, float]] = []

    def probe(address: str, timeout: float = CONNECT_TIMEOUT_SECONDS, **kwargs: object) -> bool:
        probes.append((address, timeout))
        return daemon_reachable(address, timeout, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(rank_telemetry, "daemon_reachable", probe)
    plugin = make_plugin()
    plugin.plait_configure(config=load_config({"telemetry": {"daemon": "127.0.0.1:9"}}))
    with caplog.at_level(logging.WARNING):
        plugin.plait_job_start(info=job_info())
        assert plugin.telemetry is None and plugin.exporter is None
        plugin.plait_step_start(step=0)
        plugin.plait_step_end(report=synthetic_report(0, time.time_ns()))
        plugin.plait_job_end()
    assert probes == [("127.0.0.1:9", CONNECT_TIMEOUT_SECONDS)] and CONNECT_TIMEOUT_SECONDS <= 1
    warnings = [r for r in caplog.records if "no daemon reachable" in r.getMessage()]
    assert len(warnings) == 1 and plugin.telemetry is None


def test_daemon_going_away_mid_run_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    server = DaemonServer("127.0.0.1:0", host_interval=0.2).start()
    telemetry = RankTelemetry.start(job_info(), server.address)
    assert telemetry is not None
    server.stop(grace=0)
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            telemetry.tracer.start_span("step", attributes={names.SPAN_STEP: i}).end()
            telemetry.flush(timeout_seconds=3)
        started = time.monotonic()
        telemetry.shutdown()
    # Within its own budgets (a 6 s flush, 2 s exports), not the exporters' retry schedule of a
    # minute: the bound is far from both, whatever the machine's load.
    assert time.monotonic() - started < 30.0
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("training continues" in m for m in messages) == 1, messages
    assert not any("Failed to export" in m or "Transient error" in m for m in messages), messages
