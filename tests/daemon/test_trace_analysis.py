"""The capture analysis on traces with known answers: CUDA (NCCL kernels are communication),
CPU (collectives and what runs inside them), peer waits across ranks, launch statistics, the
cross-rank verdict, and a trace `torch.profiler` records here."""

from __future__ import annotations

import itertools
import json
import random
import tempfile
from pathlib import Path

import pytest
import torch

from plait.daemon import trace_analysis as ta
from plait.daemon.profile_trace import RankCapture, merge_captures
from tests.daemon.trace_fakes import (
    CUDA_STEP,
    STEP_US,
    as_rank_trace,
    comm_span,
    cpu_trace,
    cuda_trace,
    identity,
)


def _brute(intervals: list[tuple[int, int]], size: int) -> set[int]:
    return {t for s, e in intervals for t in range(s, e) if 0 <= t < size}


def test_interval_algebra_matches_counting_points() -> None:
    rng = random.Random(7)
    for _ in range(300):
        a = [(s, s + rng.randint(0, 12)) for s in (rng.randint(0, 60) for _ in range(6))]
        b = [(s, s + rng.randint(0, 12)) for s in (rng.randint(0, 60) for _ in range(6))]
        ua, ub = ta.union(a), ta.union(b)
        assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(ua))
        assert _brute(ua, 100) == _brute(a, 100)
        assert _brute(ta.intersect(ua, ub), 100) == _brute(a, 100) & _brute(b, 100)
        assert _brute(ta.subtract(ua, ub), 100) == _brute(a, 100) - _brute(b, 100)
        assert ta.length(ta.subtract(ua, ub)) == len(_brute(a, 100) - _brute(b, 100))


def _one_rank(document: dict, **kwargs: object) -> ta.RankTraceFigures:
    trace = as_rank_trace(document)
    return ta.analyze_rank([e for e in trace.events if e["ph"] != "M"], **kwargs)  # type: ignore[arg-type]


def test_cuda_trace_classes_nccl_kernels_as_communication() -> None:
    figures = _one_rank(cuda_trace(steps=(5, 6)))
    steps = 2
    assert figures.timeline == "cuda" and figures.steps == steps
    assert figures.window_seconds == pytest.approx(steps * STEP_US / 1e6)
    assert figures.compute_seconds == pytest.approx(steps * CUDA_STEP["compute_us"] / 1e6)
    assert figures.communication_seconds == pytest.approx(
        steps * CUDA_STEP["communication_us"] / 1e6
    )
    assert figures.memory_seconds == pytest.approx(steps * CUDA_STEP["memory_us"] / 1e6)
    assert figures.communication_total_seconds == pytest.approx(
        steps * CUDA_STEP["communication_total_us"] / 1e6
    )
    assert figures.overlap_fraction == pytest.approx(
        CUDA_STEP["overlap_us"] / CUDA_STEP["communication_total_us"]
    )
    classes = (
        figures.compute_seconds + figures.communication_seconds + figures.memory_seconds
        + figures.idle_host_seconds + figures.idle_peer_wait_seconds
    )  # fmt: skip
    assert classes == pytest.approx(figures.window_seconds)
    assert figures.idle_peer_wait_seconds == 0  # no plait comm spans: nobody to wait for
    kinds = {op.name: op.kind for op in figures.top_ops}
    assert kinds["ncclDevKernel_AllReduce_Sum_f32_RING_LL"] == "communication"
    assert kinds["ampere_sgemm_128x64_tn"] == "compute"
    assert kinds["Memcpy HtoD (Pageable -> Device)"] == "memory"
    assert not any("ProfilerStep" in name for name in kinds)  # gpu_user_annotation is no kernel
    assert figures.top_ops[0].name == "ncclDevKernel_AllReduce_Sum_f32_RING_LL"  # 800 µs in all


def test_cuda_launch_statistics_follow_correlation_ids() -> None:
    figures = _one_rank(cuda_trace(steps=(1, 2)))
    assert figures.launches == 2 * CUDA_STEP["launches"]
    assert figures.launch_cpu_seconds == pytest.approx(2 * CUDA_STEP["launch_cpu_us"] / 1e6)
    delays = CUDA_STEP["launch_delays_us"]
    assert figures.launch_delay_mean_seconds == pytest.approx(sum(delays) / len(delays) / 1e6)
    assert figures.launch_delay_max_seconds == pytest.approx(max(delays) / 1e6)
    assert figures.short_kernels == 2 * CUDA_STEP["short_kernels"]


@pytest.mark.parametrize(
    "name",
    ["ncclKernel_AllGather_RING_LL_Sum_int8_t", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"],
)
def test_older_and_newer_nccl_kernel_names_are_communication(name: str) -> None:
    figures = _one_rank(cuda_trace(steps=(1,), nccl_name=name))
    assert figures.communication_total_seconds == pytest.approx(400e-6)
    assert {op.name: op.kind for op in figures.top_ops}[name] == "communication"


def test_cpu_trace_counts_what_runs_inside_a_collective_as_communication() -> None:
    main, gloo = 4242, 99
    document = cpu_trace(
        [
            ("aten::linear", "cpu_op", main, 0, 300),
            ("aten::mm", "cpu_op", main, 10, 200),
            ("aten::copy_", "cpu_op", main, 50, 20),  # inside compute: compute
            ("aten::copy_", "cpu_op", main, 320, 80),  # top level: memory
            ("c10d::allreduce_", "cpu_op", main, 420, 30),  # blocking: communication
            ("aten::add_", "cpu_op", main, 425, 10),  # inside it: communication
            ("gloo:all_reduce", "user_annotation", gloo, 200, 110),  # backend thread
            ("aten::div_", "cpu_op", gloo, 250, 50),  # the collective's own reduction
            ("aten::mul", "cpu_op", main, 600, 100),
        ],
        steps={3: (0.0, 1000.0)},
    )
    figures = _one_rank(document)
    assert figures.timeline == "cpu" and figures.steps == 1
    # compute: [0, 300] and [600, 700]; memory: [320, 400]; communication: gloo's [200, 310]
    # and the blocking call [420, 450], minus the compute under them: [300, 310], [420, 450].
    assert figures.compute_seconds == pytest.approx(400e-6)
    assert figures.memory_seconds == pytest.approx(80e-6)
    assert figures.communication_seconds == pytest.approx(40e-6)
    assert figures.communication_total_seconds == pytest.approx(140e-6)
    assert figures.overlap_fraction == pytest.approx(100 / 140)
    assert figures.idle_host_seconds == pytest.approx((1000 - 400 - 40 - 80) * 1e-6)
    kinds = {op.name: op.kind for op in figures.top_ops}
    assert kinds["aten::div_"] == "communication" and kinds["aten::add_"] == "communication"
    assert kinds["aten::mm"] == "compute"
    self_ms = {op.name: op.seconds for op in figures.top_ops}
    assert self_ms["aten::linear"] == pytest.approx((300 - 200) * 1e-6)  # self time


def _merged_two_cpu_ranks(rank1_entry_us: float) -> dict:
    """Two ranks of one all-reduce (seq 3); rank 1 enters it at `rank1_entry_us`."""
    captures = []
    for rank, entry in ((0, 100.0), (1, rank1_entry_us)):
        document = cpu_trace(
            [
                ("aten::mm", "cpu_op", 1, 0, entry),
                ("gloo:all_reduce", "user_annotation", 2, entry + 10, 500 - entry - 10),
                ("aten::mm", "cpu_op", 1, 500, 400),
            ],
            steps={1: (0.0, 1000.0)},
        )
        captures.append(
            RankCapture(
                job_id="job",
                rank=rank,
                host=f"node-{rank}",
                trace=as_rank_trace(document),
                spans=[(identity(rank), comm_span(entry, 500.0, seq=3))],
            )
        )
    return merge_captures(captures)


def test_waiting_on_a_peer_is_idle_and_the_slow_rank_is_named() -> None:
    analysis = ta.analyze(_merged_two_cpu_ranks(rank1_entry_us=400.0))
    early, late = analysis.ranks
    # Rank 0 entered at 100 µs, rank 1 at 400 µs: rank 0 waited 300 µs with nothing to run.
    assert early.idle_peer_wait_seconds == pytest.approx(300e-6)
    assert late.idle_peer_wait_seconds == 0
    assert early.communication_seconds == pytest.approx(100e-6)  # [400, 500] after all came
    for r in (early, late):
        total = (r.compute_seconds + r.communication_seconds + r.memory_seconds
                 + r.idle_host_seconds + r.idle_peer_wait_seconds)  # fmt: skip
        assert total == pytest.approx(r.window_seconds)
    summary = analysis.summary
    assert (summary.slowest_rank, summary.slowest_class) == (1, "compute")
    assert summary.excess_seconds == pytest.approx(300e-6)
    assert summary.others_wait_seconds == pytest.approx(300e-6)
    assert "rank 1 is the slowest" in summary.verdict and "compute" in summary.verdict


def test_point_to_point_ops_are_not_peer_waits() -> None:
    document = _merged_two_cpu_ranks(rank1_entry_us=400.0)
    for event in document["traceEvents"]:
        if event.get("cat") == "plait.comm":
            event["args"]["plait.comm.op"] = "recv"
    assert all(r.idle_peer_wait_seconds == 0 for r in ta.analyze(document).ranks)


def test_a_trace_without_step_annotations_uses_the_profiler_span() -> None:
    document = cpu_trace([("aten::mm", "cpu_op", 1, 100, 100)], steps={})
    document["traceEvents"].append(
        {
            "ph": "X",
            "cat": "Trace",
            "name": "PyTorch Profiler (0)",
            "pid": "Spans",
            "tid": 1,
            "ts": 0,
            "dur": 400,
            "args": {},
        }
    )
    figures = _one_rank(document)
    assert figures.steps == 0 and figures.window_seconds == pytest.approx(400e-6)
    assert figures.compute_seconds == pytest.approx(100e-6)


def test_no_delivered_rank_has_a_summary_that_says_so() -> None:
    analysis = ta.analyze({"traceEvents": [], "otherData": {"processes": {}}})
    assert analysis.ranks == () and analysis.summary.slowest_rank == -1


def test_a_trace_recorded_by_torch_profiler_adds_up() -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    data = torch.randn(32, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in (7, 8):
            with record_function(f"ProfilerStep#{step}"):
                model(data.clone()).sum().backward()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "trace.json"
        prof.export_chrome_trace(str(path))
        document = json.loads(path.read_text())
    figures = _one_rank(document)
    assert figures.timeline == "cpu" and figures.steps == 2
    total = (figures.compute_seconds + figures.communication_seconds + figures.memory_seconds
             + figures.idle_host_seconds + figures.idle_peer_wait_seconds)  # fmt: skip
    assert total == pytest.approx(figures.window_seconds)
    assert figures.compute_seconds > 0 and figures.memory_seconds > 0  # clone() is a copy
    assert figures.communication_total_seconds == 0
    assert any(op.name == "aten::addmm" for op in figures.top_ops)
    assert {op.kind for op in figures.top_ops} <= {"compute", "memory"}


def test_a_copy_under_a_collective_counts_once_as_communication() -> None:
    document = cpu_trace(
        [
            ("aten::copy_", "cpu_op", 1, 0, 100),  # top level: memory
            ("gloo:all_reduce", "user_annotation", 2, 50, 100),  # another thread, [50, 150]
        ],
        steps={1: (0.0, 200.0)},
    )
    figures = _one_rank(document)
    assert figures.communication_seconds == pytest.approx(100e-6)
    assert figures.memory_seconds == pytest.approx(50e-6)  # [0, 50]: not under the collective
    assert figures.idle_host_seconds == pytest.approx(50e-6)
    assert figures.compute_seconds == 0 and figures.overlap_fraction == 0
