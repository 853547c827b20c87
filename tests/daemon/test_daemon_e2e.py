"""End to end: a 2-rank training run exports to a daemon whose MFU matches the spans it got."""

from __future__ import annotations

import importlib.util
import json
from collections import defaultdict

import pytest

from plait.daemon import telemetry_schema as names
from plait.proto.plait.v1 import daemon_pb2
from plait.testing.distributed import run_distributed
from tests.daemon.daemon_workers import JOB_ID, train_with_telemetry

engine_available = importlib.util.find_spec("plait.core.engine") is not None
STEPS = 4


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not engine_available, reason="the training engine (plait.core.engine) is absent"
)
def test_two_rank_run_reports_to_the_daemon(daemon_server, daemon_stub) -> None:
    (result, _) = run_distributed(
        train_with_telemetry, 2, daemon_server.address, STEPS, timeout=240
    )
    ranks = daemon_stub.ListRanks(daemon_pb2.ListRanksRequest(job_id=JOB_ID)).ranks
    assert [(r.rank, r.world_size, r.steps_received) for r in ranks] == [
        (0, 2, STEPS),
        (1, 2, STEPS),
    ]
    assert all(r.peak_flops > 0 for r in ranks)
    assert all(r.peak_flops_source.startswith("cpu-calibration") for r in ranks)
    assert all(r.device == "cpu" and r.model_name == "llama" for r in ranks)
    peak = {r.rank: r.peak_flops for r in ranks}

    # Recompute MFU from the spans the daemon received (its Chrome trace of the window).
    trace = daemon_stub.CaptureTrace(daemon_pb2.CaptureTraceRequest(seconds=0, job_id=JOB_ID))
    events = [e for e in json.loads(trace.chrome_trace_json)["traceEvents"] if e["ph"] == "X"]
    step_seconds: dict[int, dict[int, float]] = defaultdict(dict)
    step_flops: dict[int, float] = {}
    for event in (e for e in events if e["cat"] == "step"):
        step = event["args"][names.SPAN_STEP]
        step_seconds[step][event["pid"]] = event["dur"] / 1e6
        step_flops[step] = event["args"][names.SPAN_STEP_MODEL_FLOPS]
    assert sorted(step_seconds) == list(range(STEPS))
    assert step_flops[0] == pytest.approx(result["flops_per_token"] * 2 * 4 * 16)
    slowest = sum(max(by_rank.values()) for by_rank in step_seconds.values())
    expected_job_mfu = sum(step_flops.values()) / slowest / (peak[0] + peak[1])

    metrics = daemon_stub.GetMetrics(
        daemon_pb2.GetMetricsRequest(job_id=JOB_ID, window_steps=STEPS)
    )
    (job,) = metrics.jobs
    assert job.ranks_reporting == 2 and job.window_steps == STEPS
    assert job.mfu > 0
    assert job.mfu == pytest.approx(expected_job_mfu, rel=1e-6)
    for rank in metrics.ranks:
        own = sum(step_seconds[s][rank.rank] for s in step_seconds)
        expected = sum(step_flops.values()) / 2 / own / peak[rank.rank]
        assert rank.mfu == pytest.approx(expected, rel=1e-6)
        assert rank.otel_metrics["plait.job.tokens"] == STEPS * 2 * 4 * 16

    # Every gradient all-reduce went through the communicate hook and was traced on both ranks.
    buckets = [e for e in events if e["args"].get(names.SPAN_COMM_PURPOSE) == "grad_bucket"]
    per_rank = defaultdict(list)
    for event in buckets:
        per_rank[event["pid"]].append(event["args"][names.SPAN_COMM_SEQ])
        assert event["args"][names.SPAN_COMM_GROUP_RANKS] == [0, 1]
    assert set(per_rank) == {0, 1} and sorted(per_rank[0]) == sorted(per_rank[1])
    assert len(per_rank[0]) >= STEPS
