"""Rank functions of the GPU tier: one CUDA rank (NCCL, world size 1)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from plait.core.engine import Engine
from plait.core.phase_timing import device_interval
from plait.plugins.checkpoint.checkpointer import Checkpointer
from plait.plugins.checkpoint.config import CheckpointIOConfig
from plait.plugins.data import build_batches


def config(**sections: dict[str, Any]) -> dict[str, Any]:
    """A small Llama (GPU-bound at these sizes) on the bundled corpus, bf16 autocast."""
    base: dict[str, Any] = {
        "model": {
            "name": "llama",
            "size": "tiny",
            "overrides": {"dim": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
                          "max_seq_len": 512},
        },
        "data": {"seq_len": 512},
        "train": {"steps": 6, "global_batch_size": 8, "micro_batch_size": 4, "seed": 3,
                  "device": "cuda"},
        "optimizer": {"lr": 1e-3, "warmup_steps": 2},
        "parallel": {"dp_strategy": "ddp", "transforms": {"precision": "amp"}},
        "amp": {"dtype": "bf16"},
        "telemetry": {"enabled": False},
    }  # fmt: skip
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base


def _batches(engine: Engine) -> Any:
    return build_batches(
        engine.config.data,
        seq_len=engine.config.data.seq_len,
        global_batch_size=engine.config.train.global_batch_size,
        dp_rank=0,
        dp_size=1,
        seed=engine.config.train.seed,
    )


def train_layouts(rank: int, world_size: int, layouts: dict[str, dict[str, Any]]) -> dict:
    """Losses of every layout over the same batches, each from a fresh engine."""
    del rank, world_size
    results = {}
    for name, sections in layouts.items():
        engine = Engine(config=config(**copy.deepcopy(sections)))
        batches = _batches(engine)
        results[name] = [engine.train_step(batches.next_batch()) for _ in range(6)]
        engine.close()
    return results


def resume_bit_exact(rank: int, world_size: int, ckpt_dir: str, dp_strategy: str) -> dict:
    """Train 4 steps straight; then 2, save, a fresh engine resumes and trains 2 more."""
    del rank, world_size
    sections = {"parallel": {"dp_strategy": dp_strategy, "transforms": {"precision": "amp"}}}

    def run(stop: int, save_at: int | None, directory: str) -> tuple[int, list[float]]:
        engine = Engine(config=config(**copy.deepcopy(sections)))
        batches = _batches(engine)
        checkpointer = Checkpointer(engine, batches, CheckpointIOConfig(dir=directory, keep=0))
        start = checkpointer.maybe_resume()
        losses = []
        for step in range(start, stop):
            losses.append(engine.train_step(batches.next_batch()))
            if save_at == step + 1:
                checkpointer.save(step + 1)
        checkpointer.close()
        engine.close()
        return start, losses

    _, straight = run(4, None, ckpt_dir + "/straight")
    run(2, 2, ckpt_dir + "/split")
    start, resumed = run(4, None, ckpt_dir + "/split")
    return {"straight": straight, "start": start, "resumed": resumed}


def phase_coverage(rank: int, world_size: int) -> dict:
    """Device time of the step's phases vs the step measured around it with synchronisation."""
    del rank, world_size
    engine = Engine(config=config())
    batches = _batches(engine)
    for _ in range(2):  # warm-up: kernels compiled, allocator settled
        engine.train_step(batches.next_batch())
    ratios = []
    for _ in range(3):
        batch = batches.next_batch()
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        engine.train_step(batch)
        torch.cuda.synchronize()
        wall = time.perf_counter_ns() - start
        intervals = [device_interval(span) for span in engine.last_report.spans]
        timed = [i for i in intervals if i is not None]
        assert timed and all(i.ready() for i in timed), "phases carry no device timing"
        device = sum(end - begin for begin, end in (i.times() for i in timed))
        ratios.append(device / wall)
    engine.close()
    return {"ratios": ratios, "phases": [s.name for s in engine.last_report.spans]}


def fp8_against_bf16(rank: int, world_size: int, steps: int) -> dict[str, list[float]]:
    """The same model and batches in bf16 and with fp8 linear layers."""
    del rank, world_size
    losses = {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        sections = {"amp": {"dtype": "bf16", "fp8": fp8}, "train": {"steps": steps}}
        engine = Engine(config=config(**sections))
        batches = _batches(engine)
        losses[name] = [engine.train_step(batches.next_batch()) for _ in range(steps)]
        engine.close()
    return losses
