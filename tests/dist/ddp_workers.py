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


class HeadFirstLM(TinyLM):
    """The same network with its modules registered head first: reverse registration order
    (DDP's first guess at the gradient order) is then the reverse of backward's real order."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.head = nn.Linear(DIM, VOCAB)
        self.blocks = TinyLM().blocks
        self.embed = nn.Embedding(VOCAB, DIM)


def bucket_layout_probe(rank: int, world_size: int) -> dict[str, Any]:
    """Bucket order before and after the first step, backward's real gradient order, whether
    every `.grad` is a view of its bucket, and the losses, with and without the rebuild."""
    del rank
    return {f"rebuild={r}": _bucket_layout(r, world_size) for r in (True, False)}


def _bucket_layout(rebuild: bool, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = HeadFirstLM()
    engine = plait.initialize(
        model,
        config={
            "ddp": {"bucket_mb": 0.01, "first_bucket_mb": 0.004, "rebuild_buckets": rebuild},
            "telemetry": {"enabled": False},
            "train": {"micro_batch_size": 2, "max_grad_norm": 1.0},
        },
        plugins=Plugins.create(autoload=False),
    )
    runtime = engine.runtimes[0]
    names = {id(p): n for n, p in model.named_parameters()}
    ready: list[str] = []
    copies: list[str] = []  # gradients that, once accumulated, were not in their bucket

    def on_ready(q: torch.Tensor) -> None:
        ready.append(names[id(q)])
        (bucket,) = [b for b in runtime.buckets if any(p is q for p in b.params)]
        if q.grad.untyped_storage().data_ptr() != bucket.buffer.untyped_storage().data_ptr():
            copies.append(names[id(q)])

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(on_ready)

    def order() -> list[list[str]]:
        return [[names[id(p)] for p in b.params] for b in runtime.buckets]

    before, losses = order(), []
    for inputs, targets in global_batches(3, 2 * world_size):
        ready.clear()
        losses.append(engine.train_step((inputs[:2], targets[:2])))
    return {
        "before": before,
        "after": order(),
        "ready_order": list(ready),
        "first_bucket_bytes": runtime.buckets[0].buffer.numel() * 4,
        "first_bucket_largest_param": max(p.numel() * 4 for p in runtime.buckets[0].params),
        # Backward accumulated straight into the buckets (checked as each gradient was ready,
        # every micro-batch of every step), and the gradients are still views after the step.
        "grads_are_bucket_views": not copies
        and all(
            p.grad is not None
            and p.grad.untyped_storage().data_ptr() == b.buffer.untyped_storage().data_ptr()
            for b in runtime.buckets
            for p in b.params
        ),
        "losses": losses,
    }
