"""Rank functions for `plait.observe` tests that need no launcher of their own."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import plait
from plait.core.errors import PlaitError


def summing_hook(state, bucket):  # type: ignore[no-untyped-def]
    """A user's comm hook: sums the buckets instead of averaging them. (No annotations: DDP
    compares them by identity, which this module's postponed annotations would fail.)"""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def user_comm_hook(rank: int, world_size: int, address: str) -> dict[str, object]:
    """A hook registered before `plait.observe` is refused; one registered after runs inside
    plait's timing hook, and its buckets are timed. Without one, plait's hook does DDP's
    default (the gradients averaged), timed as well."""
    torch.manual_seed(0)
    averaged = DDP(torch.nn.Linear(4, 4, bias=False))
    observer = plait.observe(averaged, daemon=address, job_id="default-hook")
    with observer.step():
        averaged(torch.full((1, 4), float(rank + 1))).sum().backward()
        default_records = list(observer.ledger.records)
    observer.close()
    early = DDP(torch.nn.Linear(4, 4))
    early.register_comm_hook(None, summing_hook)
    try:
        plait.observe(early, daemon=address)
        refused = ""
    except PlaitError as error:
        refused = str(error)
    model = DDP(torch.nn.Linear(4, 4, bias=False))
    observer = plait.observe(model, daemon=address, job_id="user-hook")
    model.register_comm_hook(None, summing_hook)
    with observer.step():
        model(torch.full((1, 4), float(rank + 1))).sum().backward()
        records = list(observer.ledger.records)
    observer.close()
    return {
        "refused": refused,
        "grad": model.module.weight.grad[0, 0].item(),
        "timed": [(r.op, r.purpose, r.end_ns > r.start_ns) for r in records],
        "default_grad": averaged.module.weight.grad[0, 0].item(),
        "default_timed": [(r.op, r.purpose, r.end_ns > r.start_ns) for r in default_records],
    }
