"""Rank functions: users' own models (a plain chain embed → blocks → head) pipelined on two
ranks against the plain single-process loop, and the configurations the pipeline refuses."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.core.errors import ConfigError

VOCAB, DIM, SEQ, GLOBAL_BATCH, STEPS, LR = 64, 16, 8, 8, 5, 3e-3


class Block(nn.Module):
    """A residual MLP block: takes and returns one `[batch, seq, dim]` tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ChainModel(nn.Module):
    """The documented contract: `embed`, `blocks` (a ModuleList), `head`; x = block(x)."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class NamedStack(nn.Module):
    """No repeated-block container: stages begin at modules named in pipeline.split_points."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.first = Block()
        self.mix = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.mix(self.first(self.embed(tokens))))


class Residual(ChainModel):
    """Not a chain: the head sees the embeddings too."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        h = x
        for block in self.blocks:
            h = block(h)
        return self.head(h + x)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {"chain": ChainModel, "named": NamedStack, "residual": Residual}[kind]()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def plain_loop(kind: str) -> list[float]:
    model = build(kind)
    opt = optimizer(model.parameters())
    losses = []
    for inputs, targets in batches():
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _config(overrides: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(overrides)
    config.setdefault("telemetry", {"enabled": False})
    config.setdefault("train", {}).setdefault("device", "cpu")
    return config


def train(rank: int, world_size: int, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each run: {"model": kind, "config": overrides}; losses per step, and the stage plan."""
    del rank, world_size
    results: dict[str, Any] = {}
    for kind in sorted({run["model"] for run in runs.values()}):
        results[f"reference_{kind}"] = plain_loop(kind)
    for name, run in runs.items():
        engine = plait.initialize(
            build(run["model"]), config=_config(run["config"]), optimizer=optimizer
        )
        losses = [engine.train_step(batch) for batch in batches()]
        stage_params = sorted(n for n, _ in engine.module.named_parameters())
        results[name] = {"losses": losses, "params": stage_params}
        engine.close()
    return results


def refusals(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each case: {"model": kind or "gpt2_tied", "config": overrides}; the ConfigError text."""
    del rank, world_size
    messages = {}
    for name, case in cases.items():
        model = _tied_gpt2() if case["model"] == "gpt2_tied" else build(case["model"])
        try:
            plait.initialize(model, config=_config(case["config"]), optimizer=optimizer).close()
        except ConfigError as error:
            messages[name] = str(error)
        else:
            messages[name] = "no error"
    return messages


def train_and_refuse(
    rank: int, world_size: int, runs: dict[str, dict[str, Any]], cases: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Both of the above in one spawn of the ranks."""
    return {
        "runs": train(rank, world_size, runs),
        "refusals": refusals(rank, world_size, cases),
    }


def _tied_gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=DIM, n_layer=2, n_head=2, n_positions=SEQ
    )
    return transformers.GPT2LMHeadModel(config)
