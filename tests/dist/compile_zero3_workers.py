"""Rank functions for compiled blocks under ZeRO-3 and HSDP (module level, so spawned ranks
import them): losses, full parameters, and what Dynamo compiled, broke and recompiled."""

from __future__ import annotations

import faulthandler
from collections.abc import Callable
from typing import Any

import torch

from plait.plugins import compile
from plait.plugins.models.init import normalised_name
from plait.training.banner import transform_names
from plait.training.run_records import resolved_config
from tests.dist.compile_workers import (
    GraphCalls,
    _register_counting_backend,
    make_engine,
)
from tests.dist.precision_workers import global_batches, local_share

HANG_SECONDS = 240


def _dump_stacks_if_hung() -> None:
    # A hung rank prints every thread's stack before the test's timeout kills it.
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=False)


def _dynamo_counts() -> dict[str, Any]:
    from torch._dynamo.utils import counters, guard_failures

    return {
        "graph_breaks": dict(counters["graph_break"]),
        "recompile_reasons": [r for reasons in guard_failures.values() for r in reasons],
    }


def fresh_compiler() -> None:
    """Forget what Dynamo compiled and counted, and the counting backend's tallies: each run
    starts as a new process would."""
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    GraphCalls.calls = GraphCalls.graphs = 0


def _watch_summaries(engine: Any) -> list[str] | None:
    watch = engine.plugins.manager.get_plugin(f"{compile.NAME}.watch")
    return None if watch is None else list(watch.summaries)


def train(
    rank: int, world_size: int, runs: dict[str, dict[str, Any]], steps: int, micro_batch: int
) -> dict[str, Any]:
    """Train one tiny Llama per named run on the same data; per run: losses, parameters by name
    (gathered), graphs compiled after each step, graph calls, graph breaks and recompile
    reasons."""
    _register_counting_backend()
    _dump_stacks_if_hung()
    results: dict[str, Any] = {}
    for name, run in runs.items():
        fresh_compiler()
        engine = make_engine(run, micro_batch, steps)
        losses, graphs_after_step = [], []
        for step, batch in enumerate(global_batches(steps)):
            if step >= run.get("shorter_after", steps):
                # A new sequence length after the warm-up: a real recompilation.
                batch = tuple(t[:, : t.shape[1] // 2] for t in batch)
            losses.append(engine.train_step(local_share(batch, rank, world_size)))
            graphs_after_step.append(GraphCalls.graphs)
        runtime = engine.runtimes[-1]
        with runtime.full_parameters():
            params = {
                normalised_name(n): p.detach().float().clone()
                for n, p in engine.module.named_parameters()
            }
        results[name] = {
            "losses": losses,
            "params": params,
            "graph_calls": GraphCalls.calls,
            "graphs_after_step": graphs_after_step,
            "watch": _watch_summaries(engine),
            "banner": " · ".join(transform_names(engine, resolved_config(engine))),
            "replicas": runtime.replicas.size if runtime.replicas is not None else 1,
            **_dynamo_counts(),
        }
        engine.close()
    faulthandler.cancel_dump_traceback_later()
    return results


def train_each(
    runs: dict[str, dict[str, Any]],
    start: Callable[[dict[str, Any]], tuple[Any, list[Any]]],
    **facts: Callable[[Any], Any],
) -> dict[str, Any]:
    """Train every named run from a fresh compiler, `start(run)` giving its engine and this
    rank's batches; per run: losses, this rank's parameters by name, the counting backend's
    graphs after each step and calls, the compile watch's lines, Dynamo's graph breaks and
    recompile reasons, and each of `facts` asked of the engine."""
    _register_counting_backend()
    _dump_stacks_if_hung()
    results: dict[str, Any] = {}
    for name, run in runs.items():
        fresh_compiler()
        engine, batches = start(run)
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
            **{fact: ask(engine) for fact, ask in facts.items()},
            **_dynamo_counts(),
        }
        engine.close()
    faulthandler.cancel_dump_traceback_later()
    return results
