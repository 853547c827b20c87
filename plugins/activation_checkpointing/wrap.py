"""`apply_activation_checkpointing`: wrap a model's transformer blocks in checkpoint wrappers.

torch's `CheckpointWrapper` is used rather than a wrapper of our own: it is the one torchtitan and
FSDP use, and its state-dict hooks keep checkpoint keys identical to the unwrapped model's.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

from plait.core.blocks import find_block_container
from plait.plugins.activation_checkpointing.policy import selective_context_fn

CheckpointMode = Literal["full", "every", "selective"]


def _layer_index(key: str, position: int) -> int:
    # A pipeline stage keeps global keys ("4", "5", ...) so every-k agrees with the full model.
    return int(key) if key.isdigit() else position


def wrap_block(block: nn.Module, *, selective: bool, preserve_rng_state: bool) -> nn.Module:
    """`block` inside a non-reentrant checkpoint wrapper (selective: with the SAC policy)."""
    kwargs: dict[str, Any] = {"preserve_rng_state": preserve_rng_state}
    if selective:
        kwargs["context_fn"] = selective_context_fn()
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    mode: CheckpointMode,
    every: int = 2,
    blocks: str = "",
    preserve_rng_state: bool = True,
) -> list[str]:
    """Replace the model's blocks (at attribute path `blocks`, or found automatically when it
    is empty, see `plait.core.blocks`) in place by checkpointed ones; return their keys.

    - `full`: every block recomputes its forward in backward;
    - `every`: only blocks whose layer index is a multiple of `every` do (a memory/compute
      trade-off between none and full);
    - `selective`: every block, keeping matmul and attention outputs (`policy.SAVED_OPS`).
    """
    if mode not in ("full", "every", "selective"):
        raise ValueError(f"mode must be 'full', 'every' or 'selective', got {mode!r}")
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    _, container = find_block_container(model, blocks, field="checkpoint.blocks")
    keys = (
        list(container.keys())
        if isinstance(container, nn.ModuleDict)
        else [str(i) for i in range(len(container))]
    )
    wrapped: list[str] = []
    for position, key in enumerate(keys):
        block = container[key] if isinstance(container, nn.ModuleDict) else container[position]
        if isinstance(block, CheckpointWrapper):
            continue
        if mode == "every" and _layer_index(key, position) % every != 0:
            continue
        replacement = wrap_block(
            block, selective=mode == "selective", preserve_rng_state=preserve_rng_state
        )
        if isinstance(container, nn.ModuleDict):
            container[key] = replacement
        else:
            container[position] = replacement
        wrapped.append(key)
    return wrapped
