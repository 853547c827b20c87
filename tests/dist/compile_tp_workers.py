"""Rank functions for compiled blocks under tensor parallelism (module level, so spawned ranks
import them): every rank trains on the whole batch (dp = 1), and reports its losses, its own
shards of the parameters, and what Dynamo compiled, broke and recompiled."""

from __future__ import annotations

from typing import Any

from plait.plugins.models.init import normalised_name
from tests.dist.compile_workers import GraphCalls, _register_counting_backend, make_engine
from tests.dist.compile_zero3_workers import (
    _dump_stacks_if_hung,
    _dynamo_counts,
    _watch_summaries,
    fresh_compiler,
)
from tests.dist.precision_workers import global_batches


def train(
    rank: int, world_size: int, runs: dict[str, dict[str, Any]], steps: int, micro_batch: int
) -> dict[str, Any]:
    del rank, world_size
    _register_counting_backend()
    _dump_stacks_if_hung()
    results: dict[str, Any] = {}
    for name, run in runs.items():
        fresh_compiler()
        engine = make_engine(run, micro_batch, steps)
        losses, graphs_after_step = [], []
        for batch in global_batches(steps):
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
            "tp": engine.mesh.size("tp"),
            **_dynamo_counts(),
        }
        engine.close()
    return results
