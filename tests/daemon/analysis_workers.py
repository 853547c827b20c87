"""Rank functions for the analysis tests: a stalled collective, a slow loader and a slow rank."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from plait.core.comm import Comm, world_group
from plait.core.config import load_config
from plait.core.plugins import Plugins
from plait.plugins.telemetry import make_plugin
from tests.daemon.daemon_fakes import job_info

HANG_JOB_ID = "hang"
SLOW_JOB_ID = "slow"
BUCKET_JOB_ID = "buckets"


RELEASE_TIMEOUT_SECONDS = 90.0


def wait_for_file(path: Path, timeout: float = RELEASE_TIMEOUT_SECONDS) -> None:
    """Block until `path` exists (the test creates it when it has seen what it waits for)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} was never created")
        time.sleep(0.02)


def stall_before_all_reduce(
    rank: int, world_size: int, address: str, stall_seq: int, release: str, ops: int
) -> list[float]:
    """`ops` all-reduces on the world group; rank 1 stalls before the one numbered `stall_seq`
    until the file `release` exists (the test creates it once the daemon reported the hang)."""
    plugins = Plugins.create(autoload=False, builtins=(("torch_comm", "plait.plugins.torch_comm"),))
    plugins.register(make_plugin(), "telemetry")
    plugins.configure(load_config({"telemetry": {"daemon": address}}))
    plugins.job_start(job_info(rank=rank, world_size=world_size, job_id=HANG_JOB_ID))
    # Both ranks' telemetry is up before op 0, so a slow start is not mistaken for the stall.
    torch.distributed.barrier()
    comm = Comm(plugins)
    group = world_group()
    results = []
    for seq in range(ops):
        if rank == 1 and seq == stall_seq:
            wait_for_file(Path(release))
        tensor = torch.full((1024,), float(rank + seq))
        comm.all_reduce(tensor, group=group, purpose="grad_bucket")
        results.append(tensor[0].item())
    plugins.job_end()
    return results


def bucket_finishing_under_compute(
    rank: int, world_size: int, address: str, compute_seconds: float
) -> dict[str, float]:
    """DDP's pattern on real Gloo: a bucket's async all-reduce that finishes under backward
    (the rank computes until the work reports completion), the next bucket's issue, then
    `compute_seconds` more of backward and both waited on. Returns the first bucket's recorded
    duration and how long after its start the second was issued."""
    plugins = Plugins.create(autoload=False, builtins=(("torch_comm", "plait.plugins.torch_comm"),))
    plugin = make_plugin()
    plugins.register(plugin, "telemetry")
    plugins.configure(load_config({"telemetry": {"daemon": address}}))
    plugins.job_start(job_info(rank=rank, world_size=world_size, job_id=BUCKET_JOB_ID))
    torch.distributed.barrier()
    comm = Comm(plugins)
    group = world_group()
    plugins.step_start(0)
    first = comm.all_reduce(torch.ones(4096), group=group, purpose="grad_bucket", async_op=True)
    record = plugin.records[-1]
    deadline = time.monotonic() + RELEASE_TIMEOUT_SECONDS
    while not first.is_completed():  # the backward it hides under, as long as it takes
        if time.monotonic() > deadline:
            raise TimeoutError("the first bucket's all-reduce never completed")
        time.sleep(0.005)
    second = comm.all_reduce(torch.ones(4096), group=group, purpose="grad_bucket", async_op=True)
    issued = plugin.records[-1].start_ns
    time.sleep(compute_seconds)  # the rest of backward
    first.wait()
    second.wait()
    result = {
        "first_seconds": (record.end_ns - record.start_ns) / 1e9,
        "second_issued_after": (issued - record.start_ns) / 1e9,
    }
    plugins.job_end()
    return result


def train_slow_loader_and_rank(
    rank: int,
    world_size: int,
    address: str,
    steps: int,
    data_seconds: float,
    slow_rank: int,
    forward_seconds: float,
) -> dict[str, Any]:
    """DDP on a tiny Llama; every batch takes `data_seconds` to arrive, and `slow_rank` spends
    `forward_seconds` longer in each forward (a slower device, thermally throttled, say)."""
    from plait.core.engine import Engine

    engine = Engine(
        config={
            "model": {"name": "llama", "size": "tiny"},
            "data": {"seq_len": 16},
            "train": {"micro_batch_size": 2, "global_batch_size": 4 * world_size, "seed": 0},
            "telemetry": {"enabled": True, "daemon": address, "job_id": SLOW_JOB_ID},
        },
        plugins=Plugins.create(autoload=False),
    )
    if rank == slow_rank:
        engine.module.register_forward_pre_hook(lambda module, args: time.sleep(forward_seconds))
    generator = torch.Generator().manual_seed(rank)
    vocab = engine.model_config.vocab_size
    for _ in range(steps):
        data_start = time.time_ns()
        time.sleep(data_seconds)  # the loader is slow: the batch is not ready yet
        tokens = torch.randint(0, vocab, (4, 17), generator=generator)
        engine.train_step((tokens[:, :-1], tokens[:, 1:]), data_start_ns=data_start)
    engine.close()
    return {"steps": steps}
