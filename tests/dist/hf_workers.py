"""Rank functions: `transformers` models passed to `plait.initialize` unwrapped, against a plain
single-process PyTorch loop over the same global batches.

The models come from tiny configs (nothing is downloaded) and compute their own loss from
`labels`; the batch is the dict a Hugging Face data collator makes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import plait

VOCAB, SEQ, GLOBAL_BATCH, STEPS, LR = 96, 16, 8, 5, 3e-3


def build(family: str) -> nn.Module:
    """A tiny `transformers` model of `family`, identically initialised on every rank."""
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return transformers.LlamaForCausalLM(config)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(config)
    raise ValueError(family)


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def plain_loop(family: str) -> tuple[list[float], list[float], nn.Module]:
    """The reference: the user's own loop on one process, the whole global batch per step.
    Losses, gradient norms (AdamW would hide a gradient scaled by a constant; the norm does
    not) and the trained model."""
    model = build(family)
    opt = optimizer(model.parameters())
    losses, grad_norms = [], []
    for tokens in batches():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
        grad_norms.append(torch.linalg.vector_norm(torch.stack(norms)).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grad_norms, model


def global_parameters(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter reassembled from the pieces the ranks declare they hold: what a
    checkpoint of the run would contain."""
    from plait.core.state_chunks import first_replica, layout_for, tensor_pieces

    writer = first_replica(engine)
    mine = {
        entry.name: (
            tuple(pieces.global_shape),
            [(c.offsets, c.tensor.detach().clone()) for c in pieces.chunks],
        )
        for entry in layout_for(engine).parameters
        for pieces in [tensor_pieces(entry.value, is_writer=writer)]
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full: dict[str, torch.Tensor] = {}
    for held in everyone:
        for name, (shape, chunks) in held.items():
            tensor = full.setdefault(name, torch.full(shape, float("nan")))
            for offsets, chunk in chunks:
                index = tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape, strict=True))
                tensor[index] = chunk
    return full


def max_parameter_difference(engine: Any, reference: nn.Module) -> float:
    """Largest difference between the run's reassembled parameters and the reference model's
    (NaN where a piece of a parameter is held by no rank, or a parameter is missing)."""
    full = global_parameters(engine)
    worst = 0.0
    for name, param in reference.named_parameters():
        got = full.get(name)
        if got is None or got.shape != param.shape:
            return float("nan")
        worst = max(worst, (got - param.detach()).abs().max().item())
    return worst


def train_layouts(rank: int, world_size: int, family: str, layouts: dict[str, dict]) -> dict:
    """Every layout on these ranks, each from a fresh model; losses per step by layout."""
    del rank
    reference, reference_grad_norms, reference_model = plain_loop(family)
    results: dict[str, Any] = {"reference": reference, "reference_grad_norms": reference_grad_norms}
    for name, overrides in layouts.items():
        config = copy.deepcopy(overrides)
        config.setdefault("telemetry", {"enabled": False})
        config.setdefault("train", {}).setdefault("device", "cpu")
        engine = plait.initialize(build(family), config=config, optimizer=optimizer)
        dp, dp_rank = engine.mesh.size("dp"), engine.mesh.coordinate("dp")
        share = GLOBAL_BATCH // dp
        losses, grad_norms = [], []
        for tokens in batches():
            mine = tokens[dp_rank * share : (dp_rank + 1) * share]
            losses.append(engine.train_step({"input_ids": mine, "labels": mine}))
            grad_norms.append(engine.last_report.grad_norm)
        results[name] = {
            "losses": losses,
            "grad_norms": grad_norms,
            "flops_per_token": engine.flops_per_token,
            "parameter_difference": max_parameter_difference(engine, reference_model),
        }
        engine.close()
    return results
