"""Find a model's repeated transformer blocks, for units of sharding, recomputation and stages.

ZeRO-3 units, activation checkpointing and pipeline splits all act on "the blocks". A name given
in the config wins; otherwise the blocks are found the way Hugging Face's own tooling finds
them: the container whose entries are instances of the model's `_no_split_modules` classes,
else the longest `ModuleList` / `ModuleDict` / `Sequential` whose entries share one class.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.core.errors import ConfigError

Container = nn.ModuleList | nn.ModuleDict | nn.Sequential


def module_at(model: nn.Module, path: str) -> Any:
    """The attribute at dotted `path` of `model` (e.g. "model.layers", "transformer.h")."""
    found: Any = model
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def find_block_container(model: nn.Module, path: str = "", *, field: str = "") -> tuple[str, Any]:
    """(path, container) of the model's transformer blocks; `path` wins when given."""
    if path:
        container = module_at(model, path)
        if not isinstance(container, Container) or not len(container):
            what = "nothing" if container is None else f"a {type(container).__name__}"
            raise ConfigError(
                f"{field or 'blocks'} = {path!r}: {type(model).__name__} has {what} there; "
                "expected a non-empty nn.ModuleList, nn.ModuleDict or nn.Sequential of blocks"
            )
        return path, container
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if name and isinstance(module, Container) and len(module) and _uniform(module)
    ]
    declared = set(getattr(model, "_no_split_modules", None) or ())
    if declared:
        matching = [
            (name, module)
            for name, module in candidates
            if _block_class(next(iter(module.children()))).__name__ in declared
        ]
        if matching:
            candidates = matching
    if not candidates:
        raise ConfigError(
            f"{type(model).__name__} has no container of repeated blocks (a ModuleList of one "
            f"block class); name its blocks with {field or 'the blocks setting'}"
        )
    return max(candidates, key=lambda item: len(item[1]))


def _block_class(block: nn.Module) -> type:
    # A block already wrapped for activation checkpointing counts as the block it wraps.
    return type(getattr(block, "_checkpoint_wrapped_module", block))


def _uniform(container: Any) -> bool:
    classes = {_block_class(child) for child in container.children()}
    return len(classes) == 1 and len(container) == len(list(container.children()))
