"""The planner prices checkpoint saves: what a save makes its step wait — the copy off the device,
and the write when synchronous or when it outlasts the interval — amortised over the interval.
The bytes a rank writes are the checkpoint's own: a real save's tensors are counted against the
planner's figure for the same config."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from typer.testing import CliRunner

from plait.core.engine import Engine
from plait.planner.auto import job_for_config, layout_from_config
from plait.planner.checkpoint_model import CheckpointPlan, checkpoint_cost, checkpoint_plan
from plait.planner.devices import DEVICES
from plait.planner.layouts import Job, Layout
from plait.planner.memory_model import estimate_memory
from plait.planner.published import resolve_shape
from plait.planner.search import why_slower
from plait.planner.time_model import estimate_step_time
from plait.plugins.checkpoint import checkpointer
from plait.plugins.checkpoint.config import CheckpointIOConfig
from plait.tools.cli import app
from tests.dist.checkpoint_workers import engine_batches, engine_config

H100 = DEVICES["H100-80GB"]


def job(plan: CheckpointPlan | None, **device: float) -> Job:
    return Job(
        model=resolve_shape("llama:7b"), seq_len=2048, global_batch=64, world=16, per_node=8,
        device=replace(H100, **device), checkpoint=plan,
    )  # fmt: skip


def cost(plan: CheckpointPlan, layout: Layout, step: float, **device: float):
    planned = job(plan, **device)
    saves = checkpoint_cost(planned, layout, estimate_memory(planned, layout), step)
    assert saves is not None
    return saves


ZERO3 = Layout(dp=16, zero=3)


def test_a_synchronous_save_waits_for_the_copy_and_the_write() -> None:
    saves = cost(CheckpointPlan(every=10, asynchronous=False), ZERO3, step=1.0)
    assert saves.copy_seconds > 0 and saves.write_seconds > 0
    assert saves.blocked_seconds == pytest.approx(saves.copy_seconds + saves.write_seconds)
    assert saves.per_step_seconds == pytest.approx(saves.blocked_seconds / 10)


def test_an_asynchronous_save_waits_for_the_copy_and_a_write_that_outlasts_the_interval() -> None:
    plan = CheckpointPlan(every=10, asynchronous=True)
    hidden = cost(plan, ZERO3, step=1.0)  # 10 s between saves: the write (~2 s) fits
    assert hidden.blocked_seconds == pytest.approx(hidden.copy_seconds)
    # A drive 100 times slower: the write outlasts the interval, the next save waits for it.
    slow = cost(plan, ZERO3, step=1.0, disk_bandwidth=H100.disk_bandwidth / 100)
    assert slow.write_seconds > 10.0
    excess = slow.write_seconds - 10.0
    assert slow.blocked_seconds == pytest.approx(slow.copy_seconds + excess)


def test_on_a_cpu_the_write_beside_training_costs_the_job_as_much_as_a_synchronous_one() -> None:
    """A CPU trains on every core of its host: the background write takes its time from the
    steps. The saving step is as short as on a GPU; the job pays the write all the same."""
    for every in (10, 1):  # the write fits in the interval, and it outlasts it
        cpu = {"host_memory_bytes": None}
        later = cost(CheckpointPlan(every=every, asynchronous=True), ZERO3, step=1.0, **cpu)
        now = cost(CheckpointPlan(every=every, asynchronous=False), ZERO3, step=1.0, **cpu)
        assert later.blocked_seconds < now.blocked_seconds
        assert later.per_step_seconds == pytest.approx(now.per_step_seconds)
        assert "taken from the training cores" in later.describe()
    gpu = cost(CheckpointPlan(every=10, asynchronous=True), ZERO3, step=1.0)
    assert gpu.contended_seconds == 0.0 and "training cores" not in gpu.describe()


def test_saving_only_at_the_end_costs_no_step() -> None:
    assert cost(CheckpointPlan(every=0), ZERO3, step=1.0).per_step_seconds == 0.0


def test_the_step_estimate_carries_the_term_and_ranks_layouts_by_it() -> None:
    plain = estimate_step_time(job(None), ZERO3)
    saving = estimate_step_time(job(CheckpointPlan(every=1, asynchronous=False)), ZERO3)
    assert plain.checkpoint == 0.0 and saving.checkpoint > 0.0
    assert saving.total == pytest.approx(plain.total + saving.checkpoint)
    # DDP holds the whole optimizer state on every rank: its copy off the device is 16 times
    # ZeRO-3's, which a save every step shows.
    ddp = Layout(dp=16, zero=0)
    every_step = CheckpointPlan(every=1, asynchronous=True)
    ddp_cost, zero3_cost = cost(every_step, ddp, 1.0), cost(every_step, ZERO3, 1.0)
    assert ddp_cost.copied_bytes > 10 * zero3_cost.copied_bytes
    assert ddp_cost.written_bytes == pytest.approx(zero3_cost.written_bytes, rel=0.05)


def test_a_config_says_how_often_and_how_it_saves() -> None:
    assert checkpoint_plan({}) is None
    assert checkpoint_plan({"checkpoint_io": {"every": 5}}) is None  # no dir: no saves
    assert checkpoint_plan({"checkpoint_io": {"dir": "/c", "every": 5}}) == CheckpointPlan(
        every=5, asynchronous=True
    )
    config = {**engine_config(), "checkpoint_io": {"dir": "/c", "every": 5, "async_save": False}}
    planned = job_for_config(config, world=1, per_node=1, device=H100)
    assert planned.checkpoint == CheckpointPlan(every=5, asynchronous=False)


def test_the_bytes_a_rank_writes_are_those_of_a_real_checkpoint(tmp_path: Path) -> None:
    config = engine_config()
    engine = Engine(config=config)
    batches = engine_batches(engine)
    engine.train_step(batches.next_batch())  # the optimizer state exists from the first step
    saver = checkpointer.Checkpointer(
        engine, batches, CheckpointIOConfig(dir=str(tmp_path), async_save=False, keep=0)
    )
    saver.save(1)
    saver.close()
    engine.close()
    (saved,) = tmp_path.glob("step-*")
    metadata = FileSystemReader(str(saved)).read_metadata()
    tensor_bytes = sum(
        math.prod(item.size) * item.properties.dtype.itemsize
        for item in metadata.state_dict_metadata.values()
        if isinstance(item, TensorStorageMetadata)
    )
    planned = job_for_config(
        {**config, "checkpoint_io": {"dir": str(tmp_path), "every": 1}},
        world=1, per_node=1, device=replace(H100, host_memory_bytes=None),
    )  # fmt: skip
    layout = layout_from_config(config, world=1)
    saves = checkpoint_cost(planned, layout, estimate_memory(planned, layout), 1.0)
    assert saves is not None
    # Every tensor the checkpoint holds (parameters, AdamW's moments), as its metadata counts it.
    assert saves.written_bytes == tensor_bytes


def test_plan_search_prints_the_cost_and_why_a_layout_is_slower() -> None:
    args = ["plan", "search", "llama:7b", "--world", "16", "--global-batch", "64", "--top", "3"]
    runner = CliRunner()
    synchronous = runner.invoke(app, [*args, "--checkpoint-every", "50", "--sync-checkpoints"])
    assert synchronous.exit_code == 0, synchronous.output
    assert "checkpoints every 50 steps (synchronous): the saving step waits" in synchronous.output
    asynchronous = runner.invoke(app, [*args, "--checkpoint-every", "50"])
    assert "checkpoints every 50 steps (asynchronous)" in asynchronous.output
    assert "write" in asynchronous.output and "beside training" in asynchronous.output
    # A term like any other in "why slower than #1".
    from plait.planner.search import Candidate

    planned = job(CheckpointPlan(every=1, asynchronous=False), disk_bandwidth=1e8)
    fast = Candidate(
        layout=ZERO3,
        memory=estimate_memory(planned, ZERO3),
        time=estimate_step_time(job(None), ZERO3),
    )
    ddp = Layout(dp=16, zero=0)
    slow = Candidate(
        layout=ddp, memory=estimate_memory(planned, ddp), time=estimate_step_time(planned, ddp)
    )
    assert "checkpoint saves" in why_slower(slow, fast)
