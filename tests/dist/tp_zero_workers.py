"""Rank function for tensor parallel combined with each data-parallel strategy."""

from __future__ import annotations

from typing import Any

import torch

from plait.core.engine import Engine
from plait.core.plugins import Plugins

STEPS = 4


def train_each_dp_strategy(rank: int, world_size: int, strategies: list[str]) -> dict[str, Any]:
    """TP=2 × DP=2, two micro-batches per rank, one KV head (replicated over tp)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (STEPS, 8, 17), generator=gen)
    out: dict[str, Any] = {}
    for strategy in strategies:
        engine = Engine(
            config={
                "model": {"overrides": {"n_kv_heads": 1}},
                "data": {"seq_len": 16},
                "train": {"micro_batch_size": 2, "seed": 0},
                "parallel": {"tp": 2, "dp_strategy": strategy},
                "tp": {"sequence_parallel": True},
                "telemetry": {"enabled": False},
            },
            plugins=Plugins.create(autoload=False),
        )
        dp = engine.mesh.coordinate("dp")
        losses = []
        for step in range(STEPS):
            batch = tokens[step, dp * 4 : (dp + 1) * 4]
            losses.append(engine.train_step((batch[:, :-1], batch[:, 1:])))
        wk = engine.module.layers["0"].attention.wk.weight
        if strategy == "zero3":  # between steps zero3 holds shards only: gather to read
            with engine.runtimes[-1].full_parameters():
                wk = wk.detach().clone()
        out[strategy] = {"losses": losses, "tp": engine.mesh.coordinate("tp"), "wk": wk.clone()}
    return out
