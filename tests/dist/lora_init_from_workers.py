"""Rank functions: LoRA on plait's built-in Llama from a pretrained plait checkpoint.

The "pretrained base" is the built-in Llama trained in full for a few steps and checkpointed
(`pretrain`). A LoRA job names it in `checkpoint_io.init_from` and goes through the
checkpointer the training loop uses (`Checkpointer.maybe_resume`, `maybe_save`); the reference
(`reference`) is the same job in one process whose base gets the pretrained weights written in
by hand before it trains. A job is run three ways: uninterrupted, stopped after `STOP` steps with
a checkpoint, and resumed from that checkpoint by a fresh engine of the same job.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import plait
from plait.core.errors import CheckpointError
from plait.core.state_chunks import layout_for
from tests.dist.lora_workers import (
    BUILTIN,
    BUILTIN_TARGETS,
    RANK,
    SEED,
    STEPS,
    builtin_batches,
    optimizer,
    part,
)

LORA = {
    "parallel": {"transforms": {"adapter": "lora"}},
    "peft": {"r": RANK, "alpha": 16, "target_modules": BUILTIN_TARGETS},
}
# peft's name for a module to save's trained copy (`….modules_to_save.default.weight`).
TRAINED_COPY = ".modules_to_save.default."
PRETRAIN_STEPS = 3
STOP = 2  # the interrupted job's checkpoint


def job_config(layout: dict[str, Any] | None = None, **checkpoint_io: Any) -> dict[str, Any]:
    """The LoRA job: the built-in Llama, `[peft]`, `layout`'s sections merged in (the parallel
    degrees, a schedule) and `[checkpoint_io]` as given."""
    config = copy.deepcopy({**BUILTIN, **LORA})
    for section, values in (layout or {}).items():
        config.setdefault(section, {}).update(values)
    config.update(telemetry={"enabled": False}, checkpoint_io=checkpoint_io)
    config["train"].update(device="cpu", seed=SEED, steps=STEPS)
    return config


def pretrain(folder: str) -> dict[str, torch.Tensor]:
    """The built-in Llama trained in full in this process, checkpointed at `folder`; its
    weights by checkpoint name."""
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig

    config = copy.deepcopy(BUILTIN)
    config.update(telemetry={"enabled": False})
    config["train"].update(device="cpu", seed=SEED + 1)  # another init than the LoRA job's
    engine = plait.initialize(None, config=config, optimizer=optimizer)
    for batch in builtin_batches()[:PRETRAIN_STEPS]:
        engine.train_step(batch)
    checkpointer = Checkpointer(engine, None, CheckpointIOConfig(dir=folder, async_save=False))
    checkpointer.save(PRETRAIN_STEPS)
    checkpointer.close()
    weights = {
        name: entry.value.pieces[0].read().detach().clone()
        for name, entry in layout_for(engine).by_name().items()
    }
    engine.close()
    return weights


def reference(pretrained: dict[str, torch.Tensor], layout: dict[str, Any] | None = None) -> dict:
    """The LoRA job in one process, no `init_from`: the pretrained weights written into its
    frozen base by hand before the first step, and into the trained copy of a module to save
    (`layout`'s `[peft]`), which peft would have copied from the loaded module."""
    from plait.plugins.lora.state import base_hash, digests_hash, tensor_digests

    peft = {"peft": layout["peft"]} if layout and "peft" in layout else None
    engine = plait.initialize(None, config=job_config(peft), optimizer=optimizer)
    frozen = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    copies = [(n, p) for n, p in engine.module.named_parameters() if TRAINED_COPY in n]
    with torch.no_grad():
        for name, param in frozen + copies:
            param.copy_(pretrained[_base_name(name)])
    losses = [engine.train_step(batch) for batch in builtin_batches()]
    adapters = {
        n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad
    }
    engine.close()
    # The record a base that arrived loaded gets: `base_hash` of its frozen tensors, or their
    # digests' hash where pipeline or tensor parallelism took it tensor by tensor.
    return {
        "losses": losses,
        "adapters": adapters,
        "sha256": base_hash(frozen),
        "per_tensor": digests_hash(tensor_digests(frozen)),
    }


def train(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """The LoRA job from `case["pretrained"]` on these ranks: uninterrupted, then stopped at
    `STOP` with a checkpoint, then resumed by a fresh engine (with `init_from`, and without)."""
    del world_size
    layout, pretrained, folder = case["layout"], case["pretrained"], case["folder"]
    weights = case["weights"]
    whole = _run(job_config(layout, init_from=pretrained), weights)
    saving = job_config(layout, init_from=pretrained, dir=folder, every=STOP)
    stopped = _run(saving, weights, stop=STOP)
    resumed = _run(saving, weights)
    without = job_config(layout, dir=folder)
    try:
        _run(without, weights)
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    return {
        "rank": rank,
        "whole": whole,
        "stopped": stopped,
        "resumed": resumed,
        "without_init_from": refused,
    }


def _run(config: dict[str, Any], weights: dict[str, torch.Tensor], stop: int = STEPS) -> dict:
    """One engine of `config` through the training loop's checkpointer: the step it started
    at, whether its base then held `weights`, its losses, adapters and base record."""
    from plait.plugins.checkpoint.checkpointer import Checkpointer

    engine = plait.initialize(None, config=config, optimizer=optimizer)
    try:
        checkpointer = Checkpointer.from_config(engine, None, engine.config)
        start = checkpointer.maybe_resume()
        base = layout_for(engine).left_out
        frozen = [entry for entry in base if not entry.param.requires_grad]
        base_same = bool(frozen) and _holds(frozen, weights)
        # A module to save's trained copy, left out under the base's name of the module.
        copies = [entry for entry in base if entry.param.requires_grad]
        copy_is_base = _holds(copies, weights) if copies else None
        losses = {}
        dp, size = engine.mesh.coordinate("dp"), engine.mesh.size("dp")
        share = len(builtin_batches()[0][0]) // size
        rows = slice(dp * share, (dp + 1) * share)
        for step, (inputs, targets) in enumerate(builtin_batches()[start:stop], start=start):
            losses[step] = engine.train_step((inputs[rows], targets[rows]))
            checkpointer.maybe_save(step + 1)
        checkpointer.close()
        adapters = {
            entry.name: [
                (p.region, p.read().detach().reshape(-1).clone()) for p in entry.value.pieces
            ]
            for entry in layout_for(engine).parameters
        }
        adapter = next(r for r in engine.runtimes if r.name == "lora")
        return {
            "start": start,
            "base_same": base_same,
            "copy_is_base": copy_is_base,
            "base_held": sum(entry.value.numel() for entry in base),
            "losses": losses,
            "adapters": adapters,
            "record": dict(adapter.record["base"]),  # type: ignore[attr-defined]
        }
    finally:
        engine.close()


def _holds(entries: list[Any], weights: dict[str, torch.Tensor]) -> bool:
    """Whether this rank's pieces of `entries` hold `weights` (by the entries' names)."""
    return all(
        torch.equal(piece.read().detach().reshape(-1), part(weights[entry.name], piece.region))
        for entry in entries
        for piece in entry.value.pieces
    )


def _base_name(name: str) -> str:
    """A base tensor's own name: peft's additions (and a trained copy's) dropped."""
    name = name.removeprefix("base_model.model.")
    for added in (".base_layer.", ".original_module.", TRAINED_COPY):
        name = name.replace(added, ".")
    return name
