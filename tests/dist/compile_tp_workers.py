"""Rank functions for compiled blocks under tensor parallelism (module level, so spawned ranks
import them): every rank trains on the whole batch (dp = 1), and reports its losses, its own
shards of the parameters, and what Dynamo compiled, broke and recompiled."""

from __future__ import annotations

from typing import Any

from tests.dist.compile_workers import make_engine
from tests.dist.compile_zero3_workers import train_each
from tests.dist.precision_workers import global_batches


def train(
    rank: int, world_size: int, runs: dict[str, dict[str, Any]], steps: int, micro_batch: int
) -> dict[str, Any]:
    del rank, world_size
    return train_each(
        runs,
        lambda run: (make_engine(run, micro_batch, steps), global_batches(steps)),
        tp=lambda engine: engine.mesh.size("tp"),
    )
