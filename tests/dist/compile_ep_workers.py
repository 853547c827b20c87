"""Rank functions for compiled blocks under expert parallelism (module level, so spawned ranks
import them): plait's MoE and a `transformers` Mixtral at ep = 2, eager and compiled, on the same
tokens; per run the losses, this rank's parameters and what Dynamo compiled, broke and
recompiled."""

from __future__ import annotations

from typing import Any

import plait
from plait.core.engine import Engine
from plait.plugins import compile
from plait.plugins.models.init import normalised_name
from tests.dist import hf_parallel_workers
from tests.dist.compile_workers import GraphCalls, _register_counting_backend
from tests.dist.compile_zero3_workers import (
    _dump_stacks_if_hung,
    _dynamo_counts,
    _watch_summaries,
    fresh_compiler,
)
from tests.dist.precision_workers import GLOBAL_BATCH, SEQ, global_batches, local_share


def _moe_engine(compile_section: dict[str, Any] | None, steps: int, micro_batch: int) -> Engine:
    config: dict[str, Any] = {
        "model": {"name": "moe", "size": "tiny",
                  "overrides": {"max_seq_len": SEQ, "n_layers": 2}},
        "data": {"seq_len": SEQ},
        "train": {"steps": steps, "global_batch_size": GLOBAL_BATCH,
                  "micro_batch_size": micro_batch, "seed": 0, "device": "cpu"},
        "optimizer": {"lr": 1e-2, "warmup_steps": 2, "weight_decay": 0.0},
        "telemetry": {"enabled": False},
        "parallel": {"ep": 2, "transforms": {}},
    }  # fmt: skip
    if compile_section is not None:
        config["parallel"]["transforms"]["compile"] = compile.NAME
        config["compile"] = compile_section
    return Engine(config=config)


def _hf_engine(compile_section: dict[str, Any] | None) -> Any:
    config: dict[str, Any] = {
        "parallel": {"ep": 2, "transforms": {}},
        "telemetry": {"enabled": False},
        "train": {"device": "cpu"},
    }
    if compile_section is not None:
        config["parallel"]["transforms"]["compile"] = compile.NAME
        config["compile"] = compile_section
    model = hf_parallel_workers.build("mixtral")
    return plait.initialize(model, config=config, optimizer=hf_parallel_workers.optimizer)


def _steps(
    engine: Any, family: str, rank: int, world_size: int, steps: int
) -> tuple[list[float], list[int]]:
    if family == "moe":
        batches = [local_share(batch, rank, world_size) for batch in global_batches(steps)]
    else:
        share = hf_parallel_workers.GLOBAL_BATCH // world_size
        batches = [
            {k: v[rank * share : (rank + 1) * share] for k, v in batch.items()}
            for batch in hf_parallel_workers.batches(steps)
        ]
    losses, graphs_after_step = [], []
    for batch in batches:
        losses.append(engine.train_step(batch))
        graphs_after_step.append(GraphCalls.graphs)
    return losses, graphs_after_step


def train(
    rank: int, world_size: int, runs: dict[str, dict[str, Any]], steps: int, micro_batch: int
) -> dict[str, Any]:
    """Each run names its `family` ("moe": plait's, "mixtral": transformers') and its
    `compile` section (None: eager)."""
    _register_counting_backend()
    _dump_stacks_if_hung()
    results: dict[str, Any] = {}
    for name, run in runs.items():
        fresh_compiler()
        family, section = run["family"], run.get("compile")
        engine = (
            _moe_engine(section, steps, micro_batch) if family == "moe" else _hf_engine(section)
        )
        losses, graphs_after_step = _steps(engine, family, rank, world_size, steps)
        results[name] = {
            "losses": losses,
            "params": {
                normalised_name(n): p.detach().clone() for n, p in engine.module.named_parameters()
            },
            "ep": engine.context.expert_parallel.degree,
            "graph_calls": GraphCalls.calls,
            "graphs_after_step": graphs_after_step,
            "watch": _watch_summaries(engine),
            **_dynamo_counts(),
        }
        engine.close()
    return results
