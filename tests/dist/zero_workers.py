"""Rank functions for the ZeRO tests (module level, so spawned ranks can import them).

One spawn runs several configurations in sequence (`train_runs`), so a 4-rank test pays the
start-up cost of its ranks once for every stage.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

import plait
from plait.core.engine import Engine
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins
from plait.plugins import zero

# Sizes chosen so no parameter count (nor the total) is divisible by 2 or 4.
VOCAB, SEQ, DIM, HIDDEN = 61, 16, 30, 75
STEPS, GLOBAL_BATCH = 6, 16


class Block(nn.Module):
    """A residual MLP block: the unit stage 3 wraps in these tests (`unit = ["Block"]`)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class OddLM(nn.Module):
    """A user's own model (no plait kernels) with parameter counts not divisible by 2 or 4."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def global_batches(steps: int, global_batch: int, seed: int = 0) -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (global_batch, 1), generator=gen)
        stride = torch.randint(1, 4, (global_batch, 1), generator=gen)
        tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _config(run: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train": {"micro_batch_size": run["micro_batch"], "max_grad_norm": 0.5, "seed": 0},
        "optimizer": {"lr": 1e-2, "warmup_steps": 0, "weight_decay": 0.1, "min_lr_ratio": 1.0},
        "parallel": {"dp_strategy": run["strategy"]},
        "telemetry": {"enabled": False},
        "data": {"seq_len": SEQ},
    }
    if run["strategy"].startswith("zero"):
        config["zero"] = {"bucket_mb": 0.004, "unit": ["Block"], **run.get("zero", {})}
    if run.get("builtin"):
        config["model"] = {
            "name": "llama",
            "size": "tiny",
            "overrides": {"dim": 32, "n_heads": 2, "n_kv_heads": 1},
        }
        config.get("zero", {}).pop("unit", None)
    return config


class IssueRecorder:
    """Records when each collective is issued (wall-clock ns), by purpose."""

    def __init__(self) -> None:
        self.issued: list[tuple[str, int]] = []

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: Any) -> Any:
        self.issued.append((request.purpose, time.time_ns()))
        return (yield)


def _issued_during(recorder: IssueRecorder, engine: Engine, purpose: str, phase: str) -> int:
    """How many `purpose` collectives of the last step were issued while `phase` was running."""
    spans = [s for s in engine.last_report.spans if s.name == phase]
    return sum(
        any(s.start_ns <= t < s.end_ns for s in spans) for p, t in recorder.issued if p == purpose
    )


def _named_optimizer_state(engine: Engine) -> dict[str, dict[str, Any]]:
    """The optimizer state keyed by parameter name: the runtime's full state dict for ZeRO, the
    plain optimizer's state for DDP."""
    runtime = engine.runtimes[0]
    if runtime.name.startswith("zero"):
        return runtime.state_dict()["state"]
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {names[id(p)]: dict(s) for p, s in engine.optimizer.state.items()}


def _wipe_and_reload(engine: Engine) -> None:
    """Round-trip the sharded optimizer state; NaNs make a failed reload visible in the loss."""
    runtime = engine.runtimes[0]
    saved = runtime.state_dict()
    files = runtime.master.files
    if files is not None:
        # state_dict() sends the moments back to their files in the background: bring them in
        # before touching them, or the wipe races the writer releasing their memory.
        files.fetch_all()
    for state in engine.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                value.fill_(math.nan)
    runtime.load_state_dict(saved)


def train_one(rank: int, world_size: int, run: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    config = _config(run)
    recorder = IssueRecorder()
    plugins = Plugins.create(autoload=False, extra=[("zero", zero), ("recorder", recorder)])
    if run.get("builtin"):
        engine = Engine(config=config, plugins=plugins)
    else:
        engine = plait.initialize(OddLM(), config=config, plugins=plugins)
    num_params = sum(p.numel() for p in engine.module.parameters())
    share = GLOBAL_BATCH // world_size
    losses, norms = [], []
    for step, (inputs, targets) in enumerate(global_batches(STEPS, GLOBAL_BATCH)):
        if step == STEPS - 1 and run["strategy"].startswith("zero"):
            _wipe_and_reload(engine)
        recorder.issued.clear()
        local = (
            inputs[rank * share : (rank + 1) * share],
            targets[rank * share : (rank + 1) * share],
        )
        losses.append(engine.train_step(local))
        norms.append(engine.last_report.grad_norm)
    gathers = sum(p == "param_gather" for p, _ in recorder.issued)  # the last step's
    state = _named_optimizer_state(engine)
    exp_avg = {name: s["exp_avg"].clone() for name, s in state.items()}
    return {
        "losses": losses,
        "grad_norms": norms,
        "memory": engine.memory_report(),
        "num_params": num_params,
        "exp_avg": exp_avg,
        "reductions_in_backward": _issued_during(recorder, engine, "grad_bucket", "backward"),
        "gathers_in_forward": _issued_during(recorder, engine, "param_gather", "forward"),
        "gathers_in_backward": _issued_during(recorder, engine, "param_gather", "backward"),
        "gathers": gathers,
        "microbatches": share // run["micro_batch"],
        "blocks": sum(
            u is not getattr(engine.runtimes[0], "root", None)
            for u in getattr(engine.runtimes[0], "units", ())
        ),
    }


def train_runs(rank: int, world_size: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train_one(rank, world_size, run) for run in runs]
