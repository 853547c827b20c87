"""Chrome traces of several jobs: rank 0 of one job is not rank 0 of another."""

from __future__ import annotations

import json

from plait.daemon.chrome_trace import JOB_PID_STRIDE, chrome_trace, merge_traces
from plait.daemon.decoder import RankIdentity, SpanRecord

BASE = 1_700_000_000 * 10**9


def identity(job_id: str, rank: int) -> RankIdentity:
    return RankIdentity(
        job_id=job_id, rank=rank, local_rank=rank, world_size=2, host="node-a", pid=100 + rank,
        device="cpu", device_name="cpu", compute_dtype="float32", peak_flops=0.0,
        peak_flops_source="", model_name="tiny", num_params=0, coordinates={}, degrees={},
    )  # fmt: skip


def step(start_ms: int) -> SpanRecord:
    start = BASE + start_ms * 10**6
    return SpanRecord("step", "step", start, start + 5 * 10**6, 0, {})


def process_names(document: dict) -> dict[int, str]:
    return {
        e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"
    }


def test_one_job_keeps_rank_as_process_id() -> None:
    document = chrome_trace([(identity("a", 1), step(0)), (identity("a", 0), step(1))])
    assert set(process_names(document)) == {0, 1}
    assert document["otherData"]["processes"] == {
        "0": {"job_id": "a", "rank": 0},
        "1": {"job_id": "a", "rank": 1},
    }


def test_two_jobs_get_a_process_per_rank_in_one_capture_and_across_daemons() -> None:
    spans = [(identity(job, rank), step(rank)) for job in ("b", "a") for rank in (0, 1)]
    names = process_names(chrome_trace(spans))
    assert names == {
        0: "rank 0 (node-a, job a)",
        1: "rank 1 (node-a, job a)",
        JOB_PID_STRIDE: "rank 0 (node-a, job b)",
        JOB_PID_STRIDE + 1: "rank 1 (node-a, job b)",
    }
    # Each daemon sees one job, so each capture numbers its ranks from 0; merged, they differ.
    one = json.loads(json.dumps(chrome_trace([(identity("a", 0), step(0))])))
    other = json.loads(json.dumps(chrome_trace([(identity("b", 0), step(3))])))
    merged = merge_traces([other, one])
    assert process_names(merged) == {
        0: "rank 0 (node-a, job a)",
        JOB_PID_STRIDE: "rank 0 (node-a, job b)",
    }
    spans_by_pid = {e["pid"]: e["ts"] for e in merged["traceEvents"] if e["ph"] == "X"}
    assert spans_by_pid == {0: 0.0, JOB_PID_STRIDE: 3000.0}
    sort_index = {
        e["pid"]: e["args"]["sort_index"]
        for e in merged["traceEvents"]
        if e["name"] == "process_sort_index"
    }
    assert sort_index == {0: 0, JOB_PID_STRIDE: JOB_PID_STRIDE}
