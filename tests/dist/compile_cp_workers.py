"""Rank functions for compiled blocks under context parallelism (module level, so spawned ranks
import them): every rank trains on the whole batch (dp = 1, cp = 2 cuts each sequence), plait's
Llama or a `transformers` Llama, and reports its losses, its parameters, and what Dynamo
compiled, broke and recompiled."""

from __future__ import annotations

from typing import Any

from torch import nn

import plait
from plait.core.engine import Engine
from plait.plugins import compile
from tests.dist import hf_parallel_workers
from tests.dist.compile_workers import make_engine
from tests.dist.compile_zero3_workers import train_each
from tests.dist.precision_workers import global_batches


def _transformers_engine(run: dict[str, Any]) -> Engine:
    """A tiny `transformers` Llama through `plait.initialize` (its loss from `labels`)."""
    config: dict[str, Any] = {
        "parallel": {**run["parallel"], "transforms": {}},
        "telemetry": {"enabled": False},
        "train": {"device": "cpu"},
    }
    if run.get("compile") is not None:
        config["parallel"]["transforms"]["compile"] = compile.NAME
        config["compile"] = run["compile"]
    model: nn.Module = hf_parallel_workers.build("llama")
    return plait.initialize(model, config=config, optimizer=hf_parallel_workers.optimizer)


def _start(run: dict[str, Any], steps: int, micro_batch: int) -> tuple[Engine, list[Any]]:
    if run.get("transformers"):
        return _transformers_engine(run), hf_parallel_workers.batches(steps)
    return make_engine(run, micro_batch, steps), global_batches(steps)


def train(
    rank: int, world_size: int, runs: dict[str, dict[str, Any]], steps: int, micro_batch: int
) -> dict[str, Any]:
    """Per named run (`"transformers": True` for the `transformers` Llama): what `train_each`
    records, and the cp degree."""
    del rank, world_size
    return train_each(
        runs,
        lambda run: _start(run, steps, micro_batch),
        cp=lambda engine: engine.mesh.size("cp"),
    )
