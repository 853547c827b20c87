"""How the strategy reaches into a model: its attention modules and its positions.

A model supports context parallelism when its attention modules expose `attend(q, k, v)`
(causal attention of (batch, heads, seq, head_dim) tensors) and its forward takes
`positions=` (the global positions of the tokens it is given), as plait's built-in models do.
The strategy sets `attend` on every such module and adds a forward pre-hook that passes this
rank's positions, so pipeline chunks and wrapped blocks keep working unchanged.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch
from torch import nn

from plait.core.errors import ConfigError
from plait.core.transforms import ContextParallelism


def attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if callable(getattr(m, "attend", None))]


def position_taking_modules(model: nn.Module) -> list[nn.Module]:
    found = []
    for module in model.modules():
        try:
            parameters = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        if "positions" in parameters:
            found.append(module)
    return found


def install(model: nn.Module, attend: Any, layout: ContextParallelism) -> None:
    """Route `model`'s attention through `attend` and feed it this rank's positions."""
    attentions = attention_modules(model)
    takers = position_taking_modules(model)
    if not attentions or not takers:
        missing = " and ".join(
            what
            for what, found in (
                ("no module with an attend(q, k, v) method", attentions),
                ("no forward taking positions=", takers),
            )
            if not found
        )
        raise ConfigError(
            f"context parallelism ({layout.strategy}) needs a model whose attention modules "
            f"expose attend(q, k, v) and whose forward takes positions= (plait's built-in "
            f"models do) or a transformers model whose attention goes through its "
            f"AttentionInterface; {type(model).__name__} has {missing}"
        )
    for module in attentions:
        module.attend = attend
    cache: dict[tuple[int, torch.device], torch.Tensor] = {}
    for module in takers:
        module.register_forward_pre_hook(partial(_pass_positions, layout, cache), with_kwargs=True)


def _pass_positions(
    layout: ContextParallelism,
    cache: dict[tuple[int, torch.device], torch.Tensor],
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    del module
    if kwargs.get("positions") is not None:
        return None
    tokens = args[0] if args else next(iter(kwargs.values()))
    key = (tokens.shape[1], tokens.device)
    if key not in cache:
        cache[key] = layout.local_positions(tokens.shape[1], tokens.device)
    return args, {**kwargs, "positions": cache[key]}
