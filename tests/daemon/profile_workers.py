"""Rank functions for the control-channel tests across two daemons (module level, so the
ranks a test starts can import them).

Each rank trains the tiny built-in Llama with DDP and exports to its own daemon, as ranks on two
nodes would. Between steps the ranks agree, through one plain all-reduce of a flag (outside
plait's comm facade, so it is neither traced nor heartbeated), on what the test asked for by
creating files in `control_dir`: go on, hang, or stop. A hang puts rank 0 into an all-reduce
through plait's comm facade while rank 1 sleeps in user code until `release` appears, then
joins it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.core.plugins import Plugins

JOB_ID = "two-nodes"
GO_ON, HANG, STOP = 0, 1, 2


def sleep_in_user_code(release: Path) -> None:
    """Where rank 1 is while rank 0 waits for it in the collective."""
    while not release.exists():
        time.sleep(0.05)


def _wanted(control_dir: Path) -> int:
    if (control_dir / "stop").exists():
        return STOP
    return HANG if (control_dir / "hang").exists() else GO_ON


def train_on_two_daemons(
    rank: int, world_size: int, addresses: list[str], control_dir: str
) -> dict[str, Any]:
    from plait.core.engine import Engine

    directory = Path(control_dir)
    engine = Engine(
        config={
            "model": {"name": "llama", "size": "tiny"},
            "data": {"seq_len": 16},
            "train": {"micro_batch_size": 2, "global_batch_size": 4 * world_size, "seed": 0},
            "ddp": {"bucket_mb": 0.05},
            "telemetry": {"enabled": True, "daemon": addresses[rank], "job_id": JOB_ID},
        },
        plugins=Plugins.create(autoload=False),
    )
    generator = torch.Generator().manual_seed(rank)
    flag = torch.zeros(1)
    steps = 0
    while True:
        tokens = torch.randint(0, engine.model_config.vocab_size, (4, 17), generator=generator)
        engine.train_step((tokens[:, :-1], tokens[:, 1:]))
        steps += 1
        flag.fill_(_wanted(directory))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() != GO_ON:
            break
    hung = flag.item() == HANG
    if hung:
        if rank == 1:
            sleep_in_user_code(directory / "release")
        payload = torch.ones(4)
        engine.comm.all_reduce(payload, group=engine.mesh.group("dp"), purpose="stuck_test")
    engine.close()
    return {"steps": steps, "hung": hung}
