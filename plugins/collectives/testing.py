"""Helpers for testing communication algorithms, for plait's tests and third-party plugin authors.

`train_data_parallel_mlp` trains a small MLP on a seeded regression task with data-parallel
gradient averaging done the way the DDP strategy does it — flat gradient buckets all-reduced
through `Comm` with purpose `"grad_bucket"` and a `bucket_index` attribute — so an algorithm that
takes those all-reduces over (compression, a parameter server) can be compared on final loss and
bytes against the backend's plain all-reduce, without building an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from plait.core.comm import Comm, Group


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingRun:
    """Loss on the whole dataset before training and after each step, plus the bucket sizes."""

    losses: tuple[float, ...]
    bucket_numels: tuple[int, ...]
    parameter_checksum: float


def build_mlp(*, inputs: int = 32, hidden: int = 64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
        nn.Linear(hidden, 1),
    )  # fmt: skip


def regression_dataset(
    *, samples: int = 512, inputs: int = 32, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth nonlinear target plus a little noise: learnable, but not in a few steps."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(samples, inputs, generator=generator)
    mixing = torch.randn(inputs, 4, generator=generator) / inputs**0.5
    target = torch.sin(features @ mixing).sum(dim=1, keepdim=True)
    return features, target + 0.05 * torch.randn(samples, 1, generator=generator)


def train_data_parallel_mlp(
    comm: Comm,
    group: Group,
    *,
    rank: int,
    steps: int = 40,
    lr: float = 0.1,
    batch_per_rank: int = 32,
    async_buckets: bool = True,
) -> TrainingRun:
    """Train with SGD; each rank takes its own slice of every global batch.

    Gradients are averaged in two buckets (first layer; the rest), each one flat tensor.
    """
    model = build_mlp()
    features, target = regression_dataset()
    parameters = list(model.parameters())
    buckets = [parameters[:2], parameters[2:]]
    loss_fn = nn.MSELoss()
    me, size = group.rank_of(rank), group.size

    def full_loss() -> float:
        with torch.no_grad():
            return float(loss_fn(model(features), target))

    losses = [full_loss()]
    global_batch = batch_per_rank * size
    for step in range(steps):
        start = (step * global_batch) % features.shape[0] + me * batch_per_rank
        rows = torch.arange(start, start + batch_per_rank) % features.shape[0]
        model.zero_grad(set_to_none=True)
        loss_fn(model(features[rows]), target[rows]).backward()
        flats = [torch.cat([p.grad.reshape(-1) for p in bucket]) for bucket in buckets]
        handles = [
            comm.all_reduce(
                flat,
                group=group,
                op="avg",
                async_op=async_buckets,
                purpose="grad_bucket",
                attributes={"bucket_index": index},
            )
            for index, flat in enumerate(flats)
        ]
        for handle in handles:
            handle.wait()
        with torch.no_grad():
            for bucket, flat in zip(buckets, flats, strict=True):
                offset = 0
                for p in bucket:
                    p -= lr * flat[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
        losses.append(full_loss())
    checksum = float(sum(p.detach().double().sum() for p in parameters))
    return TrainingRun(
        losses=tuple(losses),
        bucket_numels=tuple(sum(p.numel() for p in b) for b in buckets),
        parameter_checksum=checksum,
    )
