"""The `checkpoint` activation-checkpointing transform: full, every k-th block, or selective.

Selected with `parallel.transforms = { ac = "checkpoint" }` and configured in `[checkpoint]`:

    [checkpoint]
    mode = "selective"   # "full", "every" (every k-th block) or "selective" (see policy.py)
    every = 2            # for mode = "every"

Each block in the model's block container (`model.layers` by default: an `nn.ModuleDict` of the
built-in models, or an `nn.ModuleList` / `nn.Sequential`) is replaced by torch's
`CheckpointWrapper`, torchtitan's way: the wrapper's forward runs the block under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, so its intermediate activations are
freed after forward and recomputed during backward. Non-reentrant checkpointing works with
gradient hooks (data-parallel bucket reductions), keyword arguments and inputs that do not
require grad.

Parameter names: `named_parameters()` gains a `_checkpoint_wrapped_module.` component
(`layers.0._checkpoint_wrapped_module.attention.wq.weight`), while `state_dict()` keys stay those
of the unwrapped model (the wrapper strips and re-adds the component in its state-dict hooks), so
checkpoints load into either form; `plait.core.names.normalised_name` strips the
component too. Which blocks are wrapped depends on the block's key in a `ModuleDict` (its global
layer index), so every pipeline stage applies the same every-k pattern as the full model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import nn

from plait.core.config import Section
from plait.core.errors import ConfigError
from plait.core.sharding import ShardContext, Sharded
from plait.core.strategy import Strategies
from plait.core.transforms import ActivationCheckpointing
from plait.plugins.activation_checkpointing.wrap import (
    CheckpointMode,
    apply_activation_checkpointing,
)

NAME = "checkpoint"

__all__ = ["NAME", "CheckpointConfig", "CheckpointMode", "apply_activation_checkpointing"]


class CheckpointConfig(Section):
    """`[checkpoint]` section."""

    mode: Literal["full", "every", "selective"] = Field(
        "full",
        description="full: recompute every block; every: every k-th block; selective: keep "
        "matmul/attention outputs and recompute element-wise ops in every block",
    )
    every: int = Field(
        2, ge=1, description="mode = 'every': checkpoint the blocks whose index % every == 0"
    )
    blocks: str = Field(
        "",
        description="attribute path of the module holding the transformer blocks; '' = found "
        "automatically (`_no_split_modules`, else the longest list of one block class)",
    )
    preserve_rng_state: bool = Field(
        True,
        description="replay the forward's RNG state when recomputing (needed with dropout; "
        "turn off for models without randomness to save the state copies)",
    )


strategies = Strategies()


@strategies.provide(
    name=NAME,
    axis="ac",
    config_cls=CheckpointConfig,
    description="activation checkpointing of transformer blocks: full, every-k, selective",
)
def checkpoint_activations(
    model: nn.Module, *, context: ShardContext, config: CheckpointConfig
) -> Sharded:
    try:
        wrapped = apply_activation_checkpointing(
            model,
            mode=config.mode,
            every=config.every,
            blocks=config.blocks,
            preserve_rng_state=config.preserve_rng_state,
        )
    except ValueError as exc:
        raise ConfigError(f"checkpoint: {exc}") from None
    context.activation_checkpointing = ActivationCheckpointing(
        mode=config.mode, wrapped=tuple(wrapped)
    )
    return Sharded(module=model)


plait_register_strategies = strategies.plait_register_strategies
plait_shard = strategies.plait_shard
