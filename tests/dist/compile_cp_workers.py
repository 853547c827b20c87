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
from plait.plugins.models.init import normalised_name
from tests.dist import hf_parallel_workers
from tests.dist.compile_workers import GraphCalls, _register_counting_backend, make_engine
from tests.dist.compile_zero3_workers import (
    _dump_stacks_if_hung,
    _dynamo_counts,
    _watch_summaries,
    fresh_compiler,
)
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


def train(
    rank: int, world_size: int, runs: dict[str, dict[str, Any]], steps: int, micro_batch: int
) -> dict[str, Any]:
    """Per named run (`"transformers": True` for the `transformers` Llama): losses, parameters
    by name, the counting backend's graphs after each step and calls, the compile watch's lines,
    the cp degree, graph breaks and recompile reasons."""
    del rank, world_size
    _register_counting_backend()
    _dump_stacks_if_hung()
    results: dict[str, Any] = {}
    for name, run in runs.items():
        fresh_compiler()
        if run.get("transformers"):
            engine = _transformers_engine(run)
            batches: list[Any] = hf_parallel_workers.batches(steps)
        else:
            engine = make_engine(run, micro_batch, steps)
            batches = global_batches(steps)
        losses, graphs_after_step = [], []
        for batch in batches:
            losses.append(engine.train_step(batch))
            graphs_after_step.append(GraphCalls.graphs)
        results[name] = {
            "losses": losses,
            "params": {
                normalised_name(n): p.detach().clone() for n, p in engine.module.named_parameters()
            },
            "graph_calls": GraphCalls.calls,
            "graphs_after_step": graphs_after_step,
            "watch": _watch_summaries(engine),
            "cp": engine.mesh.size("cp"),
            **_dynamo_counts(),
        }
        engine.close()
    return results
