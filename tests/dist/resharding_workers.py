"""Rank functions for the resharding tests: train on one layout, save, resume on another."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from plait.core.engine import Engine
from plait.plugins.checkpoint.checkpointer import Checkpointer
from plait.plugins.checkpoint.config import CheckpointIOConfig
from tests.dist.checkpoint_workers import engine_batches, engine_config

# Layouts by name: the `parallel` and `schedule` sections that select them.
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"parallel": {"dp_strategy": "ddp"}},
    "zero2": {"parallel": {"dp_strategy": "zero2"}},
    "zero3": {"parallel": {"dp_strategy": "zero3"}},
    "tp2": {"parallel": {"tp": 2}},
    "pp2": {"parallel": {"pp": 2}, "schedule": {"name": "1f1b"}},
    # Two chunks per rank: parameters live under `chunks.stage<k>.` in the rank's module.
    "pp2_interleaved": {
        "parallel": {"pp": 2},
        "schedule": {"name": "interleaved_1f1b", "virtual_stages": 2},
    },
}


def layout_config(layout: str, steps: int, n_layers: int = 2) -> dict[str, Any]:
    config = engine_config()
    config["model"]["overrides"]["n_layers"] = n_layers
    config["parallel"] = {**config["parallel"], **LAYOUTS[layout]["parallel"]}
    if "schedule" in LAYOUTS[layout]:
        config["schedule"] = LAYOUTS[layout]["schedule"]
    config["train"] = {**config["train"], "steps": steps}
    return config


def train_with_checkpoints(
    config: dict[str, Any], ckpt_dir: str, steps: int, save_at: Iterable[int], resume: bool
) -> tuple[Engine, int, dict[int, float]]:
    """Train to `steps` with the bundled data, resuming from `ckpt_dir`'s latest checkpoint if
    asked and saving after the steps in `save_at`; the (closed) engine, the step it started at
    and the losses by step."""
    engine = Engine(config=config)
    batches = engine_batches(engine)
    checkpointer = Checkpointer(
        engine, batches, CheckpointIOConfig(dir=ckpt_dir, resume=resume, keep=0)
    )
    start = checkpointer.maybe_resume()
    saves = set(save_at)
    losses: dict[int, float] = {}
    for step in range(start, steps):
        losses[step] = engine.train_step(batches.next_batch())
        if step + 1 in saves:
            checkpointer.save(step + 1)
    checkpointer.close()
    engine.close()
    return engine, start, losses


def train_on_layout(
    rank: int,
    world_size: int,
    layout: str,
    ckpt_dir: str,
    steps: int,
    save_at: tuple[int, ...],
    resume: bool,
    n_layers: int = 2,
) -> dict[str, Any]:
    """Train `steps` steps on `layout` (after resuming from `ckpt_dir`'s latest checkpoint if
    asked), saving after the steps in `save_at`; return the losses by step."""
    del world_size
    engine, start, losses = train_with_checkpoints(
        layout_config(layout, steps, n_layers), ckpt_dir, steps, save_at, resume
    )
    return {
        "rank": rank,
        "start": start,
        "losses": losses,
        "runtimes": [runtime.name for runtime in engine.runtimes],
        "degrees": dict(engine.mesh.degrees),
        "local_numel": sum(p.numel() for p in engine.module.parameters()),
    }


def hf_export_then_import(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """A 2-way tensor-parallel job exports HF safetensors; a ZeRO-2 job initialised from another
    seed imports them. Returns the ZeRO-2 job's parameters before and after the import."""
    del rank, world_size
    from pathlib import Path

    from plait.plugins.huggingface.weights import export_hf_from, load_hf_into

    tp = Engine(config=layout_config("tp2", 1))
    export_hf_from(tp, Path(out_dir))
    tp.close()
    config = layout_config("zero2", 1)
    config["train"] = {**config["train"], "seed": 99}
    zero = Engine(config=config)
    before = {name: p.detach().clone() for name, p in zero.module.named_parameters()}
    loaded = load_hf_into(zero, Path(out_dir))
    after = {name: p.detach().clone() for name, p in zero.module.named_parameters()}
    zero.close()
    return {"before": before, "after": after, "loaded": loaded}
