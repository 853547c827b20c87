"""Rank functions: a tiny transformers Llama with LoRA adapters (peft) under DDP and ZeRO-1/2/3,
against the same adapters trained in one process by a plain loop.

The adapters are added either by plait's `lora` transform (`[peft]`) or by the user with peft
before `plait.initialize`. Each run reports its losses, the bytes its gradient collectives
carried per step, its optimizer-state bytes, its adapter parameters after training (whole, or
this rank's ZeRO ranges of them) and whether the frozen base stayed as built.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch
from torch import nn

import plait
from plait.core.comm_algorithms import GRAD_BUCKET
from plait.core.hookspecs import hookimpl

VOCAB, SEQ, GLOBAL_BATCH, STEPS, LR, SEED = 96, 16, 4, 4, 1e-2, 7
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK = 8


def build() -> nn.Module:
    """The base model, identically initialised on every rank."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def users_peft_model() -> nn.Module:
    """What a user builds with peft alone (same adapters as `[peft]` below, same seed)."""
    import peft

    model = build()
    config = peft.LoraConfig(
        r=RANK, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM"
    )
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        return peft.get_peft_model(model, config)


def batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)
        out.append({"input_ids": tokens, "labels": tokens.clone()})
    return out


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def plain_loop() -> dict[str, Any]:
    """The reference: peft's model trained by the user's loop, whole global batches."""
    model = users_peft_model()
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for batch in batches():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "adapters": trained}


class GradientBytes:
    """A comm wrapper, as telemetry is: bytes of every gradient-bucket collective."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: Any) -> Any:
        if request.purpose == GRAD_BUCKET:
            self.bytes[request.op] += max(t.numel() * t.element_size() for t in request.tensors)
        return (yield)


def train_cases(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, Any]:
    """Every case, one after the other, on these ranks (one start-up for all of them)."""
    return {name: train(rank, world_size, case) for name, case in cases.items()}


def train(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train `case` on these ranks; what the test compares with the plain loop."""
    from plait.core.plugins import Plugins
    from plait.core.state_layout import describe_state

    config = copy.deepcopy(case["config"])
    config.update(telemetry={"enabled": False}, train={"device": "cpu", "seed": SEED})
    recorder = GradientBytes()
    plugins = Plugins.create(autoload=False, extra=[("gradient_bytes", recorder)])
    model = users_peft_model() if case.get("users_model") else build()
    base = {n: p.detach().clone() for n, p in build().named_parameters()}
    if rank == 1:  # a replica that starts from other values (frozen ones too) gets rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    engine = plait.initialize(model, config=config, optimizer=optimizer, plugins=plugins)
    share = GLOBAL_BATCH // engine.mesh.size("dp")  # cp ranks share their dp rank's rows
    dp_rank = engine.mesh.coordinate("dp")
    losses = []
    for batch in batches():
        recorder.bytes.clear()
        mine = {k: v[dp_rank * share : (dp_rank + 1) * share] for k, v in batch.items()}
        losses.append(engine.train_step(mine))
    module = engine.module
    trainable = [p for p in module.parameters() if p.requires_grad]
    # What checkpoints hold: with the transform, the adapters alone (the base is hashed).
    saved = describe_state(engine.module, engine.optimizer, engine.runtimes, engine.mesh)
    saved_frozen = sum(not entry.param.requires_grad for entry in saved.parameters)
    # How the data-parallel runtime holds the base: every runtime but the adapter's.
    runtimes = [r for r in engine.runtimes if r.name != "lora"]
    layout = describe_state(engine.module, engine.optimizer, runtimes, engine.mesh)
    pieces: dict[str, list[tuple[tuple[int, int], torch.Tensor]]] = {}
    frozen_same, frozen_held = True, 0
    for entry in layout.parameters:
        for piece in entry.value.pieces:
            region = piece.region
            flat = region.flat or (0, region.numel)
            values = piece.read().detach().reshape(-1)
            if entry.param.requires_grad:
                pieces.setdefault(entry.name, []).append((flat, values))
                continue
            # The frozen base (whole, or this rank's ZeRO-3 range of it) is still as built, by
            # its transformers name (peft inserts `base_layer` into the adapted layers' names).
            expected = base[_base_name(entry.name)].reshape(-1)[flat[0] : flat[1]]
            frozen_same = frozen_same and torch.equal(values, expected)
            frozen_held += values.numel()
    memory = engine.memory_report()
    return {
        "losses": losses,
        "gradient_bytes_last_step": dict(recorder.bytes),
        "optimizer_state_bytes": memory["optimizer_state"],
        "frozen_bytes": memory.get("frozen_parameters"),
        "frozen_held": frozen_held,
        "frozen_in_checkpoints": saved_frozen,
        "adapter_numel": sum(p.numel() for p in trainable),
        "frozen_numel": sum(p.numel() for p in module.parameters() if not p.requires_grad),
        "base_numel": sum(t.numel() for t in base.values()),
        "frozen_unchanged": frozen_same,
        "adapter_pieces": pieces,
        "module_class": type(module).__name__,
        "cp": engine.mesh.size("cp"),
    }


def _base_name(name: str) -> str:
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")
