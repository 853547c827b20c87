"""Rank functions: a tiny transformers Llama with LoRA adapters (peft) under DDP, ZeRO-1/2/3,
context and pipeline parallelism, against the same adapters trained in one process by a plain
loop; and plait's built-in Llama pipelined and tensor-parallel (each alone and both together)
with the transform, against the transform in one process.

The adapters are added either by plait's `lora` transform (`[peft]`) or by the user with peft
before `plait.initialize`. Each run reports its losses, the bytes its gradient collectives
carried per step, its gradient and optimizer-state bytes, its adapter parameters after training
(whole, or this rank's ZeRO ranges of them), whether the frozen base stayed as built and the
base record its checkpoints hold.
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

import plait
from plait.core.comm_algorithms import GRAD_BUCKET, TP_GRAD
from plait.core.errors import ConfigError
from plait.core.hookspecs import hookimpl
from plait.core.state_layout import Region

VOCAB, SEQ, GLOBAL_BATCH, STEPS, LR, SEED = 96, 16, 4, 4, 1e-2, 7
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK = 8
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
# plait's built-in Llama, as small as the transformers one; its attention is wq, wk, wv, wo.
BUILTIN = {
    "model": {"name": "llama", "size": "tiny", "overrides": {
        "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "multiple_of": 16,
        "max_seq_len": 64, "vocab_size": VOCAB,
    }},
    "data": {"seq_len": SEQ},
    "train": {"global_batch_size": GLOBAL_BATCH},
}  # fmt: skip
# The head too: under tensor parallelism a column-parallel linear outside every parallel region.
BUILTIN_TARGETS = ["wq", "wk", "wv", "wo", "output"]


def build() -> nn.Module:
    """The base model, identically initialised on every rank."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def users_peft_model(modules_to_save: list[str] | None = None) -> nn.Module:
    """What a user builds with peft alone (same adapters as `[peft]` below, same seed)."""
    import peft

    model = build()
    config = peft.LoraConfig(
        r=RANK,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=TARGETS,
        modules_to_save=modules_to_save,
        task_type="CAUSAL_LM",
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


def builtin_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of the built-in model: the next token of each position."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def plain_loop(modules_to_save: list[str] | None = None) -> dict[str, Any]:
    """The reference: peft's model trained by the user's loop, whole global batches."""
    model = users_peft_model(modules_to_save)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for batch in batches():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    built = users_peft_model(modules_to_save).named_parameters()
    frozen = [(n, p.detach().clone()) for n, p in built if not p.requires_grad]
    with torch.no_grad():
        logits = model(input_ids=batches()[0]["input_ids"]).logits
    return {"losses": losses, "adapters": trained, "frozen": frozen, "logits": logits}


def builtin_one_process(config: dict[str, Any]) -> dict[str, Any]:
    """The reference of the built-in model: the transform in one process, whole batches."""
    engine = plait.initialize(None, config=_job_config(config), optimizer=optimizer)
    losses = [engine.train_step(batch) for batch in builtin_batches()]
    module = engine.module
    trained = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    with torch.no_grad():
        logits = module(builtin_batches()[0][0])
    return {"losses": losses, "adapters": trained, "frozen": frozen, "logits": logits}


def _job_config(config: dict[str, Any]) -> dict[str, Any]:
    job = copy.deepcopy(config)
    job.update(telemetry={"enabled": False})
    job.setdefault("train", {}).update(device="cpu", seed=SEED)
    return job


class GradientBytes:
    """A comm wrapper, as telemetry is: bytes of every gradient-bucket collective, and of every
    sum of a replicated parameter's gradient over tensor-parallel ranks."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.tp_bytes = 0

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: Any) -> Any:
        size = max((t.numel() * t.element_size() for t in request.tensors), default=0)
        if request.purpose == GRAD_BUCKET:
            self.bytes[request.op] += size
        elif request.purpose == TP_GRAD:
            self.tp_bytes += size
        return (yield)


def train_cases(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, Any]:
    """Every case, one after the other, on these ranks (one start-up for all of them); a case
    marked `refused` reports the configuration error it raised instead."""
    results = {}
    for name, case in cases.items():
        if not case.get("refused"):
            results[name] = train(rank, world_size, case)
            continue
        try:
            train(rank, world_size, case)
        except ConfigError as exc:
            results[name] = {"error": str(exc)}
        else:
            results[name] = {"error": None}
    return results


def train(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train `case` on these ranks; what the test compares with the plain loop."""
    from plait.core.plugins import Plugins
    from plait.core.state_layout import describe_state

    config = _job_config(case["config"])
    recorder = GradientBytes()
    plugins = Plugins.create(autoload=False, extra=[("gradient_bytes", recorder)])
    builtin = case.get("builtin", False)
    model = None if builtin else users_peft_model() if case.get("users_model") else build()
    base = {} if builtin else {n: p.detach().clone() for n, p in build().named_parameters()}
    if model is not None and rank == 1 and case.get("replicas", True):
        # a replica that starts from other values (frozen ones too) gets rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    engine = plait.initialize(model, config=config, optimizer=optimizer, plugins=plugins)
    share = GLOBAL_BATCH // engine.mesh.size("dp")  # cp ranks share their dp rank's rows
    rows = slice(engine.mesh.coordinate("dp") * share, (engine.mesh.coordinate("dp") + 1) * share)
    losses = []
    for batch in builtin_batches() if builtin else batches():
        recorder.bytes.clear()
        recorder.tp_bytes = 0
        if isinstance(batch, tuple):
            losses.append(engine.train_step((batch[0][rows], batch[1][rows])))
        else:
            losses.append(engine.train_step({k: v[rows] for k, v in batch.items()}))
    module = engine.module
    trainable = [p for p in module.parameters() if p.requires_grad]
    # What checkpoints hold: with the transform, the adapters alone (the base is hashed).
    saved = describe_state(engine.module, engine.optimizer, engine.runtimes, engine.mesh)
    saved_frozen = sum(not entry.param.requires_grad for entry in saved.parameters)
    # How the data-parallel runtime holds the base: every runtime but the adapter's.
    runtimes = [r for r in engine.runtimes if r.name != "lora"]
    layout = describe_state(engine.module, engine.optimizer, runtimes, engine.mesh)
    # The adapters as checkpoints name them (one process's peft names, under any layout).
    pieces: dict[str, list[tuple[Region, torch.Tensor]]] = {}
    for entry in saved.parameters:
        for piece in entry.value.pieces if entry.param.requires_grad else ():
            values = piece.read().detach().reshape(-1)
            pieces.setdefault(entry.name, []).append((piece.region, values))
    frozen_same, frozen_held = True, 0
    for entry in layout.parameters:
        for piece in entry.value.pieces if not entry.param.requires_grad else ():
            values = piece.read().detach().reshape(-1)
            # The frozen base (whole, or this rank's ZeRO-3 range or tp slice of it) is still as
            # built, by its transformers name (peft inserts `base_layer` into the adapted layers'
            # names).
            if base:
                expected = part(base[_base_name(entry.name)], piece.region)
                frozen_same = frozen_same and torch.equal(values, expected)
            frozen_held += values.numel()
    resumed_same = None
    if case.get("checkpoint"):
        resumed_same = _save_and_resume(engine, config, case["checkpoint"], builtin=builtin)
    memory = engine.memory_report()
    adapter = [r for r in engine.runtimes if r.name == "lora"]
    return {
        "losses": losses,
        "gradient_bytes_last_step": dict(recorder.bytes),
        "tp_gradient_bytes_last_step": recorder.tp_bytes,
        "tp": engine.mesh.size("tp"),
        "gradient_bytes_held": memory["gradients"],
        "optimizer_state_bytes": memory["optimizer_state"],
        "base_record": adapter[0].record["base"] if adapter else None,  # type: ignore[attr-defined]
        "resumed_same": resumed_same,
        "pp": engine.mesh.size("pp"),
        "stage": engine.mesh.coordinate("pp"),
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


def _save_and_resume(
    engine: Any, config: dict[str, Any], folder: str, *, builtin: bool = False
) -> bool:
    """Save `engine`'s checkpoint, load it into a fresh engine of the same job (on the base as
    built: its hash is checked), and whether that engine's adapters and Adam moments are
    `engine`'s."""
    from plait.core.state_chunks import layout_for
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig
    from plait.plugins.checkpoint.storage import resolve_checkpoint

    checkpointer = Checkpointer(engine, None, CheckpointIOConfig(dir=folder))
    checkpointer.save(STEPS)
    checkpointer.close()
    fresh = plait.initialize(None if builtin else build(), config=config, optimizer=optimizer)
    Checkpointer(fresh, None, CheckpointIOConfig(dir=folder)).load(resolve_checkpoint(Path(folder)))
    # Compared as the state layouts hold them (ZeRO's shards and masters, tp slices): ZeRO-3
    # frees the module's own parameters between steps.
    trained, loaded = layout_for(engine).by_name(), layout_for(fresh).by_name()
    same = set(trained) == set(loaded)
    for name, entry in trained.items() if same else ():
        states = entry.optimizer_state, loaded[name].optimizer_state
        # Adam's moments of every piece this rank holds (a ZeRO-3 rank may hold none).
        held = set(ADAM_MOMENTS) <= set(states[0]) or not entry.value.pieces
        same = same and held and set(states[0]) == set(states[1])
        tensors = [(entry.value, loaded[name].value)]
        tensors += [(states[0][k], states[1][k]) for k in states[0] if same]
        for ours, theirs in tensors:
            pairs = zip(ours.pieces, theirs.pieces, strict=True)
            same = same and all(
                a.region == b.region and torch.equal(a.read(), b.read()) for a, b in pairs
            )
    fresh.close()
    return same


def part(whole: torch.Tensor, region: Region) -> torch.Tensor:
    """The elements of `whole` a piece at `region` holds, flattened."""
    block = whole[tuple(slice(o, o + n) for o, n in zip(region.offsets, region.sizes, strict=True))]
    flat = block.reshape(-1)
    return flat if region.flat is None else flat[region.flat[0] : region.flat[1]]


def _base_name(name: str) -> str:
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")
