"""Peak FLOP/s: exact device names, the job's compute dtype, and the per-host CPU cache."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from plait.core.host import CACHE_ENV
from plait.core.step import JobInfo
from plait.daemon import peak_flops
from plait.daemon.peak_flops import (
    DEVICE_NAME_ALIASES,
    DEVICE_PEAK_TFLOPS,
    lookup_device_peak_flops,
    peak_flops_for,
)
from plait.daemon.telemetry_resource import peak_flops_for_job

TINY_MEASUREMENT = {
    "size": 64,
    "trial_seconds": 0.02,
    "trials": 2,
    "warmup_seconds": 0.01,
    "probe_seconds": 0.01,
}


@pytest.mark.parametrize(
    ("name", "entry"),
    [
        ("NVIDIA L40", "L40"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA  a100-sxm4-80gb ", "A100"),  # case and spacing are not part of a name
    ],
)
def test_device_names_match_exactly(name: str, entry: str) -> None:
    peak = lookup_device_peak_flops(name, "bfloat16")
    assert peak is not None
    assert peak.flops == pytest.approx(DEVICE_PEAK_TFLOPS[entry]["bfloat16"] * 1e12)
    assert peak.source == f"table: {entry} bfloat16 dense"


def test_l40_is_not_an_l4_and_no_name_matches_by_substring() -> None:
    l40, l4 = (
        lookup_device_peak_flops("NVIDIA L40", "float16"),
        lookup_device_peak_flops("NVIDIA L4", "float16"),
    )
    assert l40 is not None and l4 is not None and l40.flops != l4.flops
    assert lookup_device_peak_flops("NVIDIA L40G", "bfloat16") is None
    assert lookup_device_peak_flops("NVIDIA H100 80GB HBM3 (MIG 1g.10gb)", "bfloat16") is None
    assert lookup_device_peak_flops("NVIDIA A10G", "bfloat16") is None  # not an A10
    assert set(DEVICE_NAME_ALIASES.values()) <= set(DEVICE_PEAK_TFLOPS)


def _job_info(**changes: object) -> JobInfo:
    info = JobInfo(
        job_id="j", rank=0, local_rank=0, world_size=1, host="h", degrees={}, coordinates={},
        device="cuda:0", device_name="NVIDIA H100 80GB HBM3", compute_dtype="float32",
        model_name="m", num_params=1, flops_per_token=1.0, tokens_per_step=1,
    )  # fmt: skip
    return dataclasses.replace(info, **changes)  # type: ignore[arg-type]


def test_gpu_peak_follows_the_jobs_compute_dtype() -> None:
    bf16 = peak_flops_for_job(_job_info(compute_dtype="bfloat16"))
    assert bf16.flops == pytest.approx(989.4e12) and "bfloat16 dense" in bf16.source
    with pytest.warns(UserWarning, match="no peak FLOP/s known"):
        assert peak_flops_for("cuda:0", "NVIDIA L40G", "bfloat16").flops == 0.0


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "torch.bfloat16", "BF16"])
def test_every_spelling_of_a_dtype_finds_its_column(spelling: str) -> None:
    """Config fields say `bf16`, torch says `torch.bfloat16`: one column of the table (a
    benchmark that asked in `bf16` once got 0 and divided by it on an H200)."""
    found = peak_flops_for("cuda:0", "NVIDIA H200", spelling)
    assert found.flops == pytest.approx(989.4e12) and "bfloat16 dense" in found.source
    assert lookup_device_peak_flops("NVIDIA H100 PCIe", "fp16").flops == pytest.approx(756.5e12)


def test_amp_bf16_engine_on_a_faked_h100_uses_the_bf16_dense_peak() -> None:
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins
    from plait.plugins import precision

    config = {
        "model": {"name": "llama", "size": "tiny"},
        "data": {"seq_len": 16},
        "train": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 2, "device": "cpu"},
        "telemetry": {"enabled": False},
        "amp": {"dtype": "bf16", "param_dtype": "fp32"},  # autocast: fp32 parameters
        "parallel": {"transforms": {"precision": precision.NAME}},
    }
    plugins = Plugins.create(autoload=False, extra=[("precision", precision)])
    engine = Engine(config=config, plugins=plugins)
    try:
        info = engine.job_info()
        assert next(engine.module.parameters()).dtype.is_floating_point
        assert info.compute_dtype == "bfloat16"
        faked = dataclasses.replace(info, device="cuda:0", device_name="NVIDIA H100 80GB HBM3")
        peak = peak_flops_for_job(faked)
        assert peak.flops == pytest.approx(DEVICE_PEAK_TFLOPS["H100 SXM"]["bfloat16"] * 1e12)
    finally:
        engine.close()


def test_cpu_peak_is_measured_once_and_read_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    first, path = peak_flops.host_cpu_calibration(measure_kwargs=TINY_MEASUREMENT)
    assert path.parent == tmp_path and path.name.startswith("cpu-peak-")
    assert first.flops > 0 and first.cores == peak_flops.host_cores()
    assert first.dtype == max(first.probe_flops, key=first.probe_flops.__getitem__)

    def no_measurement(**_: object) -> None:
        raise AssertionError("the cached figure must be used")

    monkeypatch.setattr(peak_flops, "measure_cpu_peak", no_measurement)
    again, _ = peak_flops.host_cpu_calibration()
    assert again == first
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    rank_peak = peak_flops_for("cpu", "any", "bfloat16")  # the dtype does not pick the figure
    assert rank_peak.flops == pytest.approx(first.flops / 2)
    assert rank_peak.source.startswith(peak_flops.CPU_SOURCE)


def test_a_corrupt_cache_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    peak_flops.calibration_path().write_text("{not json")
    calibration, path = peak_flops.host_cpu_calibration(measure_kwargs=TINY_MEASUREMENT)
    assert calibration.flops > 0
    assert json.loads(path.read_text())["flops"] == calibration.flops


RANK = textwrap.dedent(
    """
    import json, sys
    from plait.daemon import peak_flops
    calibration, _ = peak_flops.host_cpu_calibration(measure_kwargs=json.loads(sys.argv[1]))
    print(json.dumps({"flops": calibration.flops, "by": calibration.measured_by}))
    """
)


def test_two_ranks_of_one_host_share_one_measurement(tmp_path: Path) -> None:
    env = dict(os.environ, **{CACHE_ENV: str(tmp_path)})
    measurement = json.dumps(dict(TINY_MEASUREMENT, trial_seconds=0.3))
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, measurement], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [json.loads(rank.communicate(timeout=120)[0]) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks)
    # One process measured (under the lock); the other waited and read the same file.
    assert outputs[0] == outputs[1]
    assert outputs[0]["by"].rsplit(":", 1)[1] in {str(rank.pid) for rank in ranks}


def calibration(flops: float, *, share: float | None, age: float) -> peak_flops.CpuCalibration:
    return peak_flops.CpuCalibration(
        flops=flops, dtype="float32", probe_flops={"float32": flops}, cpu_model="test",
        cores=2, gemm_size=1024, seconds=3.0, measured_at=time.time() - age,
        measured_by="test:1", cpu_share=share,
    )  # fmt: skip


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Write a cached calibration; measurements return the next figure of `measured`."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    measured: list[peak_flops.CpuCalibration] = []
    monkeypatch.setattr(peak_flops, "measure_cpu_peak", lambda **_: measured.pop(0))

    def write(cached: peak_flops.CpuCalibration) -> list[peak_flops.CpuCalibration]:
        peak_flops.calibration_path().write_text(json.dumps(dataclasses.asdict(cached)))
        return measured

    return write


HOUR = peak_flops.UNSETTLED_RETRY_SECONDS


def test_a_figure_measured_on_a_busy_host_is_measured_again_later(cache: Any) -> None:
    """A GEMM that shared the cores reads low; ranks on a quiet host would then show MFU above
    100 %. It is used for a while (no measurement at every start), then measured again."""
    measured = cache(calibration(78e9, share=0.5, age=60))
    assert peak_flops.host_cpu_calibration()[0].flops == 78e9  # recent: used as it is
    measured = cache(calibration(78e9, share=0.5, age=HOUR + 1))
    measured.append(calibration(160e9, share=0.99, age=0))
    again, path = peak_flops.host_cpu_calibration()
    assert again.flops == 160e9 and again.settled
    assert json.loads(path.read_text())["flops"] == 160e9
    # Settled: never measured again, however old.
    measured = cache(calibration(160e9, share=0.99, age=100 * HOUR))
    assert peak_flops.host_cpu_calibration()[0].flops == 160e9


def test_a_slower_measurement_never_lowers_the_cached_figure(cache: Any) -> None:
    measured = cache(calibration(160e9, share=0.6, age=HOUR + 1))
    measured.append(calibration(90e9, share=0.5, age=0))  # busier still
    kept, _ = peak_flops.host_cpu_calibration()
    assert kept.flops == 160e9 and not kept.settled
    assert not kept.due_again()  # retried an hour from now, not at the next start
    # A file from before the share was recorded counts as unsettled.
    old = dataclasses.asdict(calibration(70e9, share=None, age=HOUR + 1))
    del old["cpu_share"]
    peak_flops.calibration_path().write_text(json.dumps(old))
    measured.append(calibration(150e9, share=0.95, age=0))
    assert peak_flops.host_cpu_calibration()[0].flops == 150e9


def test_a_forced_measurement_replaces_the_figure(cache: Any) -> None:
    measured = cache(calibration(160e9, share=0.99, age=0))
    measured.append(calibration(120e9, share=0.99, age=0))
    assert peak_flops.host_cpu_calibration(force=True)[0].flops == 120e9


def test_the_measurement_records_whether_it_had_the_cores() -> None:
    measured = peak_flops.measure_cpu_peak(**TINY_MEASUREMENT)
    assert measured.cpu_share is not None and 0 < measured.cpu_share <= 1.0
