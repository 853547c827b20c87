"""Rank functions for data parallelism on 2 nodes x 2 ranks (torchrun's environment, Gloo):
the tiny built-in model trained flat and hierarchically, exporting to a daemon."""

from __future__ import annotations

from typing import Any

import torch

from plait.core.plugins import Plugins
from plait.testing.distributed import VOCAB_SIZE, merged_config
from tests.dist.host_workers import as_nodes

STEPS = 3
GLOBAL_BATCH = 8


def train_as_nodes(
    rank: int, world_size: int, nnodes: int, runs: dict[str, str], address: str
) -> dict[str, Any]:
    """Train the tiny Llama with DDP under each `runs` entry (job id -> comm.algorithm, "" for
    the default choice); return losses, final parameters and the gradient bytes."""
    from plait.core.engine import Engine

    if nnodes:
        as_nodes(rank, world_size, nnodes)
    out: dict[str, Any] = {}
    for job_id, algorithm in runs.items():
        overrides: dict[str, Any] = {
            "train": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2},
            "ddp": {"bucket_mb": 0.05},
            "telemetry": {"enabled": bool(address), "daemon": address, "job_id": job_id},
        }
        if algorithm:
            overrides["comm"] = {"algorithm": algorithm}
        config = merged_config(overrides)
        tokens = torch.randint(
            0, VOCAB_SIZE, (STEPS, GLOBAL_BATCH, 17), generator=torch.Generator().manual_seed(0)
        )
        engine = Engine(config=config, plugins=Plugins.create(autoload=False))
        dp, dp_size = engine.mesh.coordinate("dp"), engine.mesh.size("dp")
        share = GLOBAL_BATCH // dp_size
        losses = []
        for step in range(STEPS):
            batch = tokens[step, dp * share : (dp + 1) * share]
            losses.append(engine.train_step((batch[:, :-1], batch[:, 1:])))
        parameters = [p for p in engine.module.parameters() if p.requires_grad]
        out[job_id] = {
            "losses": losses,
            "parameters": torch.cat([p.detach().reshape(-1) for p in parameters]),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in parameters),
            "numels": [p.numel() for p in parameters],
            "host_map": engine.mesh.host_map.describe() if engine.mesh.host_map else "",
        }
        engine.close()
    return out
