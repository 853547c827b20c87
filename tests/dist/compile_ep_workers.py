"""Rank functions for compiled blocks under expert parallelism (module level, so spawned ranks
import them): plait's MoE and a `transformers` Mixtral at ep = 2, eager and compiled, on the same
tokens; per run the losses, this rank's parameters and what Dynamo compiled, broke and
recompiled."""

from __future__ import annotations

from typing import Any

import plait
from plait.core.engine import Engine
from plait.plugins import compile
from tests.dist import hf_parallel_workers
from tests.dist.compile_zero3_workers import train_each
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


def _start(
    run: dict[str, Any], rank: int, world_size: int, steps: int, micro_batch: int
) -> tuple[Any, list[Any]]:
    section = run.get("compile")
    if run["family"] == "moe":
        batches = [local_share(batch, rank, world_size) for batch in global_batches(steps)]
        return _moe_engine(section, steps, micro_batch), batches
    share = hf_parallel_workers.GLOBAL_BATCH // world_size
    batches = [
        {k: v[rank * share : (rank + 1) * share] for k, v in batch.items()}
        for batch in hf_parallel_workers.batches(steps)
    ]
    return _hf_engine(section), batches


def train(
    rank: int, world_size: int, runs: dict[str, dict[str, Any]], steps: int, micro_batch: int
) -> dict[str, Any]:
    """Each run names its `family` ("moe": plait's, "mixtral": transformers') and its
    `compile` section (None: eager); what `train_each` records, and the ep degree."""
    return train_each(
        runs,
        lambda run: _start(run, rank, world_size, steps, micro_batch),
        ep=lambda engine: engine.context.expert_parallel.degree,
    )
