"""ZeRO's offload (`[zero.offload]`) counted by the planner: the memory model moves the optimizer
state (and stage 3's parameter shards) from the device to the host, exactly as
`plait.plugins.zero` places them; the time model prices the host link and the CPU optimizer
step; `plait plan` proposes offload only when nothing fits without; the dry run names it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plait.planner.auto import (
    auto_config,
    job_for_config,
    layout_config,
    layout_from_config,
    merge_sections,
)
from plait.planner.devices import DEVICES, Link, device_spec
from plait.planner.layouts import PRECISIONS, Job, Layout, SearchSpace, enumerate_layouts
from plait.planner.memory_model import estimate_memory
from plait.planner.published import resolve_shape
from plait.planner.search import plan
from plait.planner.time_model import estimate_step_time
from plait.tools.cli import app

TINY = {"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256}
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def _job(**overrides: object) -> Job:
    values: dict[str, object] = dict(
        model=resolve_shape("llama:tiny", TINY),
        seq_len=128,
        global_batch=16,
        world=4,
        per_node=4,
        device=device_spec("H100-80GB"),
        precision=PRECISIONS["fp32"],
    )
    values.update(overrides)
    return Job(**values)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ memory model


def test_cpu_offload_moves_adams_state_off_the_device_byte_for_byte() -> None:
    job = _job()
    params = job.model.num_params
    shard = params / 4  # zero1 over dp = 4
    on_device = estimate_memory(job, Layout(dp=4, zero=1, micro_batch=4))
    offloaded = estimate_memory(job, Layout(dp=4, zero=1, micro_batch=4, offload="cpu"))
    # fp32 AdamW: 8 bytes of state per parameter of the shard leave the device, nothing else
    assert on_device.optimizer_state == pytest.approx(8 * shard)
    assert offloaded.optimizer_state == 0 and offloaded.master_weights == 0
    assert on_device.total - offloaded.total == pytest.approx(8 * shard)
    assert offloaded.parameters == pytest.approx(4 * params)  # stage 1 keeps the weights
    assert offloaded.gradients == on_device.gradients
    assert offloaded.activations == on_device.activations
    # the host: an fp32 master of the shard (the device's fp32 weights are not the CPU's),
    # fp32 gradient copies for the CPU optimizer, and the state
    assert offloaded.host_optimizer_state == pytest.approx(8 * shard)
    assert offloaded.host_master_weights == pytest.approx(4 * shard)
    assert offloaded.host_gradients == pytest.approx(4 * shard)
    assert offloaded.host_parameters == 0 and offloaded.disk_optimizer_state == 0
    assert offloaded.host_total == pytest.approx(16 * shard)
    assert on_device.host_total == 0 and on_device.offload == "none"


def test_stage3_offload_also_moves_the_parameter_shards() -> None:
    fp32 = _job()
    params = fp32.model.num_params
    shard = params / 4
    plain = estimate_memory(fp32, Layout(dp=4, zero=3, micro_batch=4))
    moved = estimate_memory(fp32, Layout(dp=4, zero=3, micro_batch=4, offload="cpu"))
    assert plain.parameters == pytest.approx(4 * shard)
    assert moved.parameters == 0 and moved.optimizer_state == 0
    assert moved.buffers == plain.buffers > 0  # the units gathered for compute stay
    assert plain.total - moved.total == pytest.approx((4 + 8) * shard)
    assert moved.host_parameters == pytest.approx(4 * shard)
    assert moved.host_master_weights == 0  # an fp32 shard on the host is its own master
    assert moved.host_total == pytest.approx((4 + 4 + 8) * shard)
    mixed = _job(precision=PRECISIONS["bf16"])
    bf16 = estimate_memory(mixed, Layout(dp=4, zero=3, micro_batch=4, offload="cpu"))
    assert bf16.host_parameters == pytest.approx(2 * shard)
    assert bf16.host_master_weights == pytest.approx(4 * shard)
    assert bf16.master_weights == 0


def test_nvme_keeps_the_state_in_files_and_ddp_reads_no_offload() -> None:
    job = _job()
    shard = job.model.num_params / 4
    cpu = estimate_memory(job, Layout(dp=4, zero=2, micro_batch=4, offload="cpu"))
    nvme = estimate_memory(job, Layout(dp=4, zero=2, micro_batch=4, offload="nvme"))
    assert nvme.disk_optimizer_state == pytest.approx(8 * shard)
    assert nvme.total == cpu.total and nvme.host_total == cpu.host_total  # read back to step
    ddp = estimate_memory(job, Layout(dp=4, zero=0, micro_batch=4, offload="cpu"))
    assert ddp == estimate_memory(job, Layout(dp=4, zero=0, micro_batch=4))


# -------------------------------------------------------------------------------- time model


def test_offload_prices_the_host_link_and_the_cpu_optimizer_step() -> None:
    link = Link(alpha=1e-5, beta=20e9)
    device = dataclasses.replace(DEVICES["H100-80GB"], host_link=link, host_memory_bandwidth=40e9)
    job = _job(device=device)
    shard = job.model.num_params / 4
    base = estimate_step_time(job, Layout(dp=4, zero=1, micro_batch=4))
    moved = estimate_step_time(job, Layout(dp=4, zero=1, micro_batch=4, offload="cpu"))
    # gradients (4 bytes) down before the step, parameters (4 bytes) up after it
    assert moved.offload == pytest.approx(2 * (link.alpha + 4 * shard / link.beta))
    # masters, gradient copies and AdamW state, read and written on the host
    assert moved.optimizer == pytest.approx(shard * 2 * (4 + 4 + 8) / 40e9)
    assert moved.total == pytest.approx(sum(moved.terms().values()))
    assert base.offload == 0 and moved.compute == base.compute
    # a CPU is its own host: offload moves nothing and costs nothing
    cpu_job = _job(device=dataclasses.replace(device, host_memory_bytes=None))
    on_cpu = estimate_step_time(cpu_job, Layout(dp=4, zero=1, micro_batch=4, offload="cpu"))
    assert on_cpu == estimate_step_time(cpu_job, Layout(dp=4, zero=1, micro_batch=4))
    kept = estimate_memory(cpu_job, Layout(dp=4, zero=1, micro_batch=4, offload="cpu"))
    assert kept.total == estimate_memory(cpu_job, Layout(dp=4, zero=1, micro_batch=4)).total
    assert kept.host_total == 0 and kept.optimizer_state > 0
    files = estimate_memory(cpu_job, Layout(dp=4, zero=1, micro_batch=4, offload="nvme"))
    assert files.disk_optimizer_state == kept.optimizer_state and files.total == kept.total


# ------------------------------------------------------------------------------------ search


def _single_gpu_job(memory_bytes: float, **device: object) -> Job:
    spec = dataclasses.replace(DEVICES["A100-80GB"], memory_bytes=memory_bytes, **device)
    return Job(
        model=resolve_shape("llama:7b"), seq_len=2048, global_batch=8, world=1, per_node=1,
        device=spec, precision=PRECISIONS["bf16"],
    )  # fmt: skip


def _smallest(job: Job, offload: str) -> float:
    return min(estimate_memory(job, lay).total for lay in enumerate_layouts(job, offload=offload))


def test_the_plan_offloads_only_when_nothing_fits_without() -> None:
    probe = _single_gpu_job(80 * 2**30)
    fraction = probe.device.usable_memory_fraction
    without, offloaded = _smallest(probe, "none"), _smallest(probe, "cpu")
    assert offloaded < without  # a 7B model on one GPU: offload is what makes room
    only_offload = _single_gpu_job((offloaded + without) / 2 / fraction)
    result = plan(only_offload)
    assert result.offloaded and result.ranked
    assert all(c.layout.offloaded and c.layout.offload == "cpu" for c in result.ranked)
    assert "offload-cpu" in result.best.layout.describe()
    assert result.best.memory.total <= only_offload.device.usable_memory
    assert result.best.memory.host_total <= only_offload.device.usable_host_memory
    assert result.best.time.offload > 0
    # room without offload: never proposed, however the offloaded ones compare
    roomy = plan(_single_gpu_job(without * 1.05 / fraction))
    assert roomy.ranked and not roomy.offloaded
    assert not any(c.layout.offloaded for c in roomy.ranked)
    # no host beside the device, or too little of it: nothing fits
    assert not plan(
        _single_gpu_job(only_offload.device.memory_bytes, host_memory_bytes=None)
    ).ranked
    small_host = _single_gpu_job(only_offload.device.memory_bytes, host_memory_bytes=2**30)
    assert not plan(small_host).ranked
    assert not plan(only_offload, SearchSpace(offload=())).ranked


def test_auto_writes_the_offload_and_reads_it_back() -> None:
    config = {
        "model": {"name": "llama", "size": "7b"},
        "data": {"seq_len": 2048},
        "train": {"global_batch_size": 8, "steps": 3},
        "zero": {"offload": {"io_workers": 3}},
    }
    roomy_host = dataclasses.replace(DEVICES["A100-80GB"], host_memory_bytes=1024 * 2**30)
    probe = job_for_config(config, world=1, per_node=1, device=roomy_host)
    without, offloaded = _smallest(probe, "none"), _smallest(probe, "cpu")
    fraction = roomy_host.usable_memory_fraction
    tight = dataclasses.replace(roomy_host, memory_bytes=(offloaded + without) / 2 / fraction)
    merged, result = auto_config(config, world=1, per_node=1, device=tight)
    assert result.offloaded and result.best.layout.offloaded
    assert merged["zero"]["offload"] == {"io_workers": 3, "device": "cpu"}  # the rest is kept
    assert layout_from_config(merged, world=1) == result.best.layout
    roomy = dataclasses.replace(roomy_host, memory_bytes=without * 1.05 / fraction)
    merged, result = auto_config(config, world=1, per_node=1, device=roomy)
    assert not result.offloaded and merged["zero"]["offload"]["device"] == "none"
    for layout in (Layout(dp=1, zero=1, offload="cpu"), Layout(dp=4, zero=3, offload="nvme")):
        round_trip = merge_sections(config, layout_config(layout))
        assert layout_from_config(round_trip, world=layout.world) == layout


# ----------------------------------------------------------------------------------- dry run


def _dry_run(*overrides: str) -> str:
    sets = [arg for pair in (("--set", o) for o in overrides) for arg in pair]
    result = CliRunner().invoke(app, ["train", str(CONFIG), "--dry-run", *sets])
    assert result.exit_code == 0, result.output
    return result.output


def _optimizer_column(output: str) -> float:
    row = next(line for line in output.splitlines() if re.match(r"^│\s+[\d,]+ │", line))
    return float(row.split("│")[4].replace(",", ""))


def test_the_dry_run_shows_the_device_without_the_state_and_the_host_with_it() -> None:
    gpu = ("parallel.dp_strategy=zero1", "train.device=cuda", "model.overrides.dim=512")
    plain = _dry_run(*gpu)
    moved = _dry_run(*gpu, "zero.offload.device=cpu")
    params = int(re.search(r"([\d,]+) parameters", moved).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert "offload (" not in plain
    assert _optimizer_column(plain) == pytest.approx(8 * params / 2**20, abs=0.05)
    assert _optimizer_column(moved) == 0.0
    line = next(ln for ln in moved.splitlines() if ln.startswith("offload ("))
    assert line.startswith("offload (zero.offload.device = cpu): host memory per rank ")
    assert f"{16 * params / 2**20:,.1f} MiB at the optimizer step" in line, line
    assert f"optimizer state {8 * params / 2**20:,.1f}" in line, line
    nvme = _dry_run(*gpu, "zero.offload.device=nvme", "zero.offload.path=/tmp/plait-offload")
    assert f"{8 * params / 2**20:,.1f} MiB per rank in files under /tmp/plait-offload" in nvme
    cpu = ("parallel.dp_strategy=zero1", "train.device=cpu", "model.overrides.dim=512")
    on_cpu = _dry_run(*cpu, "zero.offload.device=cpu")
    assert "training on the CPU" in on_cpu and "nothing moves" in on_cpu
    assert _optimizer_column(on_cpu) == _optimizer_column(plain) > 0  # counted where it stays
    files = _dry_run(*cpu, "zero.offload.device=nvme", "zero.offload.path=/tmp/plait-offload")
    assert f"state ({8 * params / 2**20:,.1f} MiB per rank) is in files under" in files
