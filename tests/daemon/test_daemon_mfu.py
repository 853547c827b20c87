"""The MFU formula on synthetic step streams, hand-computed, and the peak FLOP/s sources."""

from __future__ import annotations

import pytest

from plait.daemon.mfu import CALIBRATION_ERROR, StepSample, job_throughput, rank_throughput
from plait.daemon.peak_flops import lookup_device_peak_flops
from plait.daemon.store import union_seconds


def samples(times: list[float], flops: float = 8e12, tokens: int = 4096, world: int = 4):
    return [StepSample(step=i, seconds=t, model_flops=flops, tokens=tokens, world_size=world)
            for i, t in enumerate(times)]  # fmt: skip


def test_rank_mfu_is_its_share_of_model_flops_over_time_and_peak() -> None:
    rate = rank_throughput(samples([1.0, 2.0, 1.0]), peak_flops=3e12)
    # 3 steps × 8e12 / 4 ranks = 6e12 FLOPs in 4 s → 1.5e12 FLOP/s against 3e12 peak
    assert rate.model_flops_per_second == pytest.approx(1.5e12)
    assert rate.mfu == pytest.approx(0.5)
    assert rate.tokens_per_second == pytest.approx(3 * 4096 / 4 / 4.0)
    assert rate.step_seconds == pytest.approx(4.0 / 3)


def test_job_mfu_uses_the_slowest_rank_and_the_sum_of_peaks() -> None:
    fast, slow = samples([1.0, 1.0, 1.0], world=2), samples([1.0, 3.0, 2.0], world=2)
    rate = job_throughput({0: fast, 1: slow}, {0: 2e12, 1: 2e12}, window_steps=10)
    # steps last max(1,1)=1, max(1,3)=3, max(1,2)=2 → 6 s for 3 × 8e12 FLOPs
    assert rate.model_flops_per_second == pytest.approx(24e12 / 6)
    assert rate.peak_flops == pytest.approx(4e12)
    assert rate.mfu == pytest.approx(1.0)
    assert rate.step_seconds == pytest.approx(2.0)


def test_job_mfu_window_and_partial_ranks() -> None:
    rank0 = samples([5.0, 1.0, 1.0, 1.0], world=4)
    rank1 = samples([5.0, 1.0, 2.0], world=4)  # has not finished step 3 yet
    rate = job_throughput({0: rank0, 1: rank1}, {0: 2e12, 1: 2e12}, window_steps=2)
    # common steps {0,1,2}, last two: 1 s and 2 s; two of four ranks hold half the job
    assert rate.steps == 2
    assert rate.model_flops_per_second == pytest.approx(2 * 8e12 * 0.5 / 3.0)
    assert rate.mfu == pytest.approx(rate.model_flops_per_second / 4e12)


def test_unknown_peak_gives_zero_mfu_not_a_division_error() -> None:
    assert rank_throughput(samples([1.0]), peak_flops=0.0).mfu == 0.0
    assert job_throughput({}, {}, window_steps=5).mfu == 0.0


def test_union_of_overlapping_communication_intervals() -> None:
    assert union_seconds([(0, 10), (5, 20), (30, 40)]) == pytest.approx(30e-9)
    assert union_seconds([]) == 0.0


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4),
        ("NVIDIA H100 PCIe", "bfloat16", 756.5),
        ("NVIDIA H100 NVL", "float32", 60.0),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("NVIDIA L4", "float16", 121.0),
        ("NVIDIA L40S", "bfloat16", 362.05),
        ("AMD Instinct MI300X", "bfloat16", 1307.4),
    ],
)
def test_peak_table_by_device_name(name: str, dtype: str, tflops: float) -> None:
    peak = lookup_device_peak_flops(name, dtype)
    assert peak is not None and peak.flops == pytest.approx(tflops * 1e12)


def test_peak_table_misses() -> None:
    assert lookup_device_peak_flops("Tesla V100-SXM2-16GB", "bfloat16") is None  # no bf16
    assert lookup_device_peak_flops("Some Future GPU", "bfloat16") is None


def test_rank_above_its_peak_is_a_calibration_error_not_a_figure() -> None:
    rate = rank_throughput(samples([1.0, 2.0, 1.0]), peak_flops=1e12)  # 1.5e12 achieved
    assert rate.model_flops_per_second == pytest.approx(1.5e12)
    assert rate.mfu == CALIBRATION_ERROR


def test_top_shows_a_calibration_error_and_never_its_percentage() -> None:
    from rich.console import Console

    from plait.proto.plait.v1 import daemon_pb2, metrics_pb2
    from plait.tools.daemon_commands import render_top

    rate = rank_throughput(samples([1.0]), peak_flops=1e12)  # 2e12 achieved: above the peak
    response = daemon_pb2.GetMetricsResponse(
        ranks=[metrics_pb2.RankMetrics(job_id="j", rank=0, host="h", mfu=rate.mfu)],
        jobs=[
            metrics_pb2.JobMetrics(
                job_id="j", world_size=4, ranks_reporting=1,
                model_flops_per_second=2e12, peak_flops=1e12, mfu=rate.mfu,
            )
        ],
    )  # fmt: skip
    console = Console(record=True, width=200)
    console.print(render_top({"127.0.0.1:1": response}))
    text = console.export_text()
    assert text.count("calibration error") >= 3  # job row, rank row, advice line
    assert "200.0%" not in text and "-100.0%" not in text
    assert "plait calibrate --force" in text
