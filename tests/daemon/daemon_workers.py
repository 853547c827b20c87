"""Rank functions for the end-to-end daemon test (module level, so spawned ranks import them)."""

from __future__ import annotations

from typing import Any

import torch

from plait.core.plugins import Plugins

JOB_ID = "e2e"


def train_with_telemetry(rank: int, world_size: int, address: str, steps: int) -> dict[str, Any]:
    """A tiny built-in Llama on 2 Gloo ranks with DDP, exporting telemetry to `address`."""
    from plait.core.engine import Engine

    engine = Engine(
        config={
            "model": {"name": "llama", "size": "tiny"},
            "data": {"seq_len": 16},
            "train": {"micro_batch_size": 2, "global_batch_size": 4 * world_size, "seed": 0},
            "ddp": {"bucket_mb": 0.05},
            "telemetry": {"enabled": True, "daemon": address, "job_id": JOB_ID},
        },
        plugins=Plugins.create(autoload=False),
    )
    generator = torch.Generator().manual_seed(rank)
    vocab = engine.model_config.vocab_size
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (4, 17), generator=generator)
        engine.train_step((tokens[:, :-1], tokens[:, 1:]))
    engine.close()
    return {"flops_per_token": engine.flops_per_token}
