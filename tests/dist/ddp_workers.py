"""Rank functions for the DDP tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

import plait
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins

VOCAB, SEQ, DIM = 64, 16, 32


class TinyLM(nn.Module):
    """A user's own model: embedding, two MLP blocks, output head (no plait kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(
            nn.Linear(DIM, 4 * DIM),
            nn.GELU(),
            nn.Linear(4 * DIM, DIM),
            nn.Tanh(),
            nn.Linear(DIM, 4 * DIM),
            nn.GELU(),
            nn.Linear(4 * DIM, DIM),
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the (synchronised, clipped) gradients it is given."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(list(params), lr=lr)
        self.seen: list[dict[int, torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        grads = {}
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                grads[i] = p.grad.detach().clone()
        self.seen.append(grads)
        return super().step(closure)


def global_batches(
    steps: int, global_batch: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        # Learnable sequences: each continues an arithmetic progression mod VOCAB.
        start = torch.randint(0, VOCAB, (global_batch, 1), generator=gen)
        stride = torch.randint(1, 4, (global_batch, 1), generator=gen)
        tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def train_user_model(
    rank: int, world_size: int, steps: int, global_batch: int, micro_batch: int, bucket_mb: float
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyLM()
    holder: dict[str, RecordingSGD] = {}

    def make_optimizer(params: Any) -> RecordingSGD:
        holder["opt"] = RecordingSGD(params, lr=0.5)
        return holder["opt"]

    engine = plait.initialize(
        model,
        config={
            "train": {"micro_batch_size": micro_batch, "max_grad_norm": 1.0, "seed": 0},
            "ddp": {"bucket_mb": bucket_mb},
            "telemetry": {"enabled": False},
        },
        optimizer=make_optimizer,
        plugins=Plugins.create(autoload=False),
    )
    share = global_batch // world_size
    losses = []
    for inputs, targets in global_batches(steps, global_batch):
        local = (
            inputs[rank * share : (rank + 1) * share],
            targets[rank * share : (rank + 1) * share],
        )
        losses.append(engine.train_step(local))
    grads = [{k: v for k, v in g.items()} for g in holder["opt"].seen]
    return {"losses": losses, "grads": grads, "num_buckets": len(engine.runtimes[0].buckets)}


class IssueRecorder:
    """Records when each gradient-bucket all-reduce is issued (wall-clock ns)."""

    def __init__(self) -> None:
        self.issued_ns: list[int] = []

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: Any) -> Any:
        if request.purpose == "grad_bucket":
            self.issued_ns.append(time.time_ns())
        return (yield)


def overlap_probe(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    recorder = IssueRecorder()
    plugins = Plugins.create(autoload=False, extra=[("issue-recorder", recorder)])
    engine = plait.initialize(
        TinyLM(),
        config={
            "ddp": {"bucket_mb": 0.01},
            "telemetry": {"enabled": False},
            "train": {"micro_batch_size": 4},
        },
        plugins=plugins,
    )
    # A tensor hook fires when the parameter's gradient is computed, before it is accumulated
    # into `.grad` and so before DDP's post-accumulate hook can launch anything for it.
    ready_ns: dict[int, int] = {}
    for p in engine.module.parameters():
        p.register_hook(lambda _grad, key=id(p): ready_ns.__setitem__(key, time.time_ns()))
    ((inputs, targets),) = global_batches(1, 4 * world_size)
    engine.train_step((inputs[:4], targets[:4]))
    backward = [s for s in engine.last_report.spans if s.name == "backward"]
    buckets = engine.runtimes[0].buckets
    return {
        "issued_ns": recorder.issued_ns,
        "backward_start_ns": backward[0].start_ns,
        "backward_end_ns": backward[0].end_ns,
        "num_buckets": len(buckets),
        "last_bucket_ready_ns": [ready_ns[id(p)] for p in buckets[-1].params],
    }
