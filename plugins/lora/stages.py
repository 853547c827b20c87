"""LoRA adapters on pipeline stages: each stage adapts the linear layers it holds.

The pipeline split runs before the adapter transform (`records.SHARD_ORDER`), so the module the
transform gets on a pipeline rank is its stage: a copy of a built-in model holding its own
blocks, or a stage module around a user's or `transformers` model's own modules, under their
names in the whole model. peft adapts it as it would the whole model; the pipeline runtime calls
the stage module itself, whose linear layers peft replaced in place.

Two things one process does over the whole model are redone across the stages:

- the adapters' random draws: peft draws them in module order from one stream, so stage s
  continues the stream where stage s - 1 left it (the CPU random state is sent down the
  pipeline ranks of each replica), and the stages together hold the A matrices one process
  draws;
- the base's hash: each stage digests its own frozen tensors and every stage hashes all the
  digests (`state.digests_hash`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from plait.core.comm_algorithms import GENERIC
from plait.core.errors import ConfigError
from plait.core.sharding import ShardContext
from plait.plugins.lora.apply import add_adapters
from plait.plugins.lora.config import PeftSection
from plait.plugins.lora.state import PER_TENSOR, digests_hash, tensor_digests

PP_AXIS = "pp"


def adapt_stage(
    model: nn.Module,
    section: PeftSection,
    *,
    context: ShardContext,
    custom_layers: Mapping[type, type] | None = None,
) -> nn.Module:
    """This pipeline rank's stage with its adapters, drawn where the stages before it stopped;
    `custom_layers` as for `add_adapters` (the stage's tensor-parallel linears)."""
    group = context.mesh.group(PP_AXIS)
    stage = context.mesh.coordinate(PP_AXIS)
    start = None
    if stage > 0:
        start = torch.get_rng_state()  # a buffer of the state's size and dtype
        context.comm.recv(
            start, src=group.ranks[stage - 1], group=group, async_op=False, purpose=GENERIC
        ).wait()
    end = start
    try:
        seed = context.config.train.seed
        adapted, end = add_adapters(
            model, section, seed=seed, start=start, custom_layers=custom_layers
        )
    except ConfigError as exc:
        raise ConfigError(f"pipeline stage {stage}: {exc}") from None
    finally:
        # Sent even when this stage failed: the next one then fails on its own instead of
        # waiting for a state that never comes.
        if stage < group.size - 1:
            state = end if end is not None else torch.get_rng_state()
            context.comm.send(
                state, dst=group.ranks[stage + 1], group=group, async_op=False, purpose=GENERIC
            ).wait()
    _refuse_bypassed_adapters(adapted, context=context)
    return adapted


def _refuse_bypassed_adapters(adapted: nn.Module, *, context: ShardContext) -> None:
    """A stage around a model's own modules reaches some of them through the model (its head,
    its embeddings): an adapter peft put in the stage's place of such a module would never run."""
    assert context.pipeline is not None
    source = context.pipeline.source_model
    if source is None:
        return  # a built-in model's stage is a copy of the model: it calls what it holds
    stage_module: Any = adapted.get_base_model()  # type: ignore[operator]
    bypassed = []
    for name, module in stage_module.named_modules():
        if not hasattr(module, "base_layer"):
            continue
        try:
            reached = source.get_submodule(name)
        except AttributeError:
            reached = None
        if reached is not module:
            bypassed.append(name)
    if bypassed:
        raise ConfigError(
            f"[peft] targets {bypassed}, which a pipeline stage of {type(source).__name__} calls "
            "through the whole model, not in its blocks: with parallel.pp > 1 adapt the blocks' "
            "layers only (target_modules, exclude_modules)"
        )


def stage_base(
    frozen: Iterable[tuple[str, torch.Tensor]], *, name: str, context: ShardContext
) -> dict[str, Any]:
    """The base's record (`state.AdapterState`) hashed over every stage's frozen tensors, this
    stage's `frozen` among them, by the names peft gives them in one process. Collective over
    the pipeline ranks."""
    mine = "\n".join(tensor_digests(frozen)).encode()
    group = context.mesh.group(PP_AXIS)
    device = context.device
    size = torch.tensor([len(mine)], dtype=torch.int64, device=device)
    sizes = torch.empty(group.size, dtype=torch.int64, device=device)
    context.comm.all_gather(sizes, size, group=group, purpose=GENERIC)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    every = torch.empty(group.size * longest, dtype=torch.uint8, device=device)
    context.comm.all_gather(every, padded, group=group, purpose=GENERIC)
    lines: list[str] = []
    for rank, length in enumerate(sizes.tolist()):
        text = every[rank * longest : rank * longest + length].cpu().numpy().tobytes().decode()
        lines.extend(line for line in text.split("\n") if line)
    return {
        "name": name,
        "sha256": digests_hash(lines),
        "parameters": len(lines),
        "scheme": PER_TENSOR,
    }
