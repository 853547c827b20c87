"""Rank functions for the checkpoint tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from plait.core.engine import Engine
from plait.plugins.checkpoint.checkpointer import Checkpointer
from plait.plugins.checkpoint.config import CheckpointIOConfig
from plait.plugins.data import TokenBatches, build_batches
from plait.plugins.resilience import ResilienceConfig, attach_resilience

STEPS = 10


def engine_config(
    *,
    dp_strategy: str = "ddp",
    parallel: dict[str, Any] | None = None,
    zero: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A 2-layer Llama small enough for a busy 2-core machine."""
    config: dict[str, Any] = {
        "model": {
            "name": "llama",
            "size": "tiny",
            "overrides": {"dim": 32, "n_heads": 2, "n_kv_heads": 1, "multiple_of": 16,
                          "max_seq_len": 32},
        },
        "data": {"seq_len": 16},
        "train": {"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "seed": 7,
                  "device": "cpu"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "parallel": {"dp_strategy": dp_strategy, **(parallel or {})},
        "telemetry": {"enabled": False},
    }  # fmt: skip
    if zero:
        config["zero"] = zero
    return config


def train_and_checkpoint(
    rank: int,
    world_size: int,
    ckpt_dir: str,
    stop_at: int,
    save_at: tuple[int, ...],
    resume: bool,
    async_save: bool = False,
    parallel: dict[str, Any] | None = None,
    dp_strategy: str = "ddp",
    zero: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train until `stop_at` steps are done (resuming first if asked), saving after `save_at`."""
    del world_size
    engine = Engine(config=engine_config(dp_strategy=dp_strategy, parallel=parallel, zero=zero))
    batches = engine_batches(engine)
    settings = CheckpointIOConfig(dir=ckpt_dir, resume=resume, async_save=async_save, keep=0)
    checkpointer = Checkpointer(engine, batches, settings)
    attach_resilience(engine, ResilienceConfig())  # as the trainer does: the default guard
    start = checkpointer.maybe_resume()
    losses: dict[int, float] = {}
    for step in range(start, stop_at):
        losses[step] = engine.train_step(batches.next_batch())
        if step + 1 in save_at:
            checkpointer.save(step + 1)
    checkpointer.close()
    engine.close()
    return {"start": start, "losses": losses, "rank": rank, "rng": torch.rand(1).item()}


def engine_batches(engine: Engine) -> TokenBatches:
    """This rank's data-parallel share of the engine's configured data (no held-out split)."""
    return build_batches(
        engine.config.data,
        seq_len=engine.config.data.seq_len,
        global_batch_size=engine.config.train.global_batch_size,
        dp_rank=engine.mesh.coordinate("dp"),
        dp_size=engine.mesh.size("dp"),
        seed=engine.config.train.seed,
    )


def nonfinite_guard(rank: int, world_size: int, nan_steps: tuple[int, ...]) -> dict[str, Any]:
    """Poison one gradient on `nan_steps`; report skipped steps and whether parameters changed."""
    del rank, world_size
    from plait.plugins.resilience.nonfinite_guard import NonFiniteGradients

    engine = Engine(config=engine_config())
    attach_resilience(engine, ResilienceConfig(max_consecutive_nonfinite=2))
    param = engine.module.output.weight
    state = {"step": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if state["step"] in nan_steps:
            return torch.full_like(grad, float("nan"))
        return grad

    param.register_hook(poison)
    batches = build_batches(
        engine.config.data,
        seq_len=16,
        global_batch_size=8,
        dp_rank=engine.mesh.coordinate("dp"),
        dp_size=engine.mesh.size("dp"),
        seed=1,
    )
    skipped, changed, error = [], [], ""
    for step in range(6):
        state["step"] = step
        before = param.detach().clone()
        try:
            engine.train_step(batches.next_batch())
        except NonFiniteGradients as exc:
            error = str(exc)
            break
        skipped.append(engine.last_report.skipped)
        changed.append(not torch.equal(before, param.detach()))
    engine.close()
    return {"skipped": skipped, "changed": changed, "error": error}


def list_checkpoints(ckpt_dir: str) -> list[str]:
    return sorted(p.name for p in Path(ckpt_dir).iterdir())
