"""Rank functions for the web page's browser test: a 2-rank job paced by the test, one slow rank."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from tests.daemon.analysis_workers import wait_for_file

WEB_JOB_ID = "web"


def train_paced(
    rank: int,
    world_size: int,
    address: str,
    first_steps: int,
    paused: str,
    stop: str,
    slow_rank: int,
    forward_seconds: float,
) -> dict[str, Any]:
    """DDP on a tiny Llama exporting to `address`: `first_steps` steps, a pause until the file
    `paused` exists (the figures hold still for the test to compare), then steps until `stop`
    exists. `slow_rank` spends `forward_seconds` longer in each forward: a straggler by
    construction, however busy the machine, since its sleep adds to what every rank does."""
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins

    engine = Engine(
        config={
            "model": {"name": "llama", "size": "tiny"},
            "data": {"seq_len": 16},
            "train": {"micro_batch_size": 2, "global_batch_size": 4 * world_size, "seed": 0},
            "telemetry": {"enabled": True, "daemon": address, "job_id": WEB_JOB_ID},
        },
        plugins=Plugins.create(autoload=False),
    )
    if rank == slow_rank:
        engine.module.register_forward_pre_hook(lambda module, args: time.sleep(forward_seconds))
    generator = torch.Generator().manual_seed(rank)
    vocab = engine.model_config.vocab_size
    steps = 0

    def step() -> None:
        nonlocal steps
        tokens = torch.randint(0, vocab, (4, 17), generator=generator)
        engine.train_step((tokens[:, :-1], tokens[:, 1:]), data_start_ns=time.time_ns())
        steps += 1

    for _ in range(first_steps):
        step()
    wait_for_file(Path(paused))
    while not _agreed(Path(stop).exists()):
        step()
    engine.close()
    return {"steps": steps}


def _agreed(seen: bool) -> bool:
    """Whether any rank saw it: both ranks stop after the same step, or one would wait in a
    gradient all-reduce the other never joins."""
    flag = torch.tensor([1.0 if seen else 0.0])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())
