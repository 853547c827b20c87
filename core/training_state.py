"""The training state beside the weights that a resumed or healed engine takes in.

A checkpoint (`plait.plugins.checkpoint`) and a heal from a live replica group
(`plait.plugins.fault_tolerance`) both move weights and optimizer state through the state layout
(`plait.core.state_layout`); what is not a tensor of the layout — empty optimizer state to load
into, the optimizer's hyperparameters, the learning-rate schedule — is applied the same way by
both, here::

    ensure_optimizer_state(engine.optimizer)      # before describing the state to load into
    ...                                           # weights and optimizer tensors written
    apply_schedule(engine, param_groups=saved_groups, lr_scheduler=saved_scheduler)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from plait.core.errors import CheckpointError

GROUP_HYPERPARAMETERS = ("lr", "initial_lr", "betas", "eps", "weight_decay", "momentum")
# LR scheduler state entries with one value per optimizer parameter group.
_PER_GROUP_SCHEDULER_KEYS = ("base_lrs", "_last_lr", "lr_lambdas")


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The hyperparameters of each parameter group (no parameters): what a resume restores."""
    return [
        {k: v for k, v in group.items() if k in GROUP_HYPERPARAMETERS}
        for group in optimizer.param_groups
    ]


def empty_adam_state(optimizer: torch.optim.Optimizer, like: torch.Tensor) -> dict[str, Any]:
    """Adam state for a parameter that has not stepped yet, to load a checkpoint into.

    plait's AdamW counts steps in a Python int; torch's optimizers keep a 0-d float tensor.
    """
    from plait.core.optim import AdamW

    step: Any = 0 if isinstance(optimizer, AdamW) else torch.tensor(0.0)
    return {
        "step": step,
        "exp_avg": torch.zeros_like(like, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(like, memory_format=torch.preserve_format),
    }


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of `optimizer` that has not stepped yet empty state to load into,
    so that strategies describe (and the loader fills) state a resumed job has not built."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state.get(param):
                optimizer.state[param] = empty_adam_state(optimizer, param)


def fit_scheduler_state(state: dict[str, Any], num_groups: int) -> dict[str, Any]:
    """A scheduler state for an optimizer of `num_groups` groups.

    The number of groups can differ between layouts (a ZeRO rank has only the groups its shard
    has parameters in); a per-group list whose values are all equal fits any count.
    """
    fitted = dict(state)
    for key in _PER_GROUP_SCHEDULER_KEYS:
        values = state.get(key)
        if not isinstance(values, list) or len(values) == num_groups:
            continue
        if not values or any(v != values[0] for v in values):
            raise CheckpointError(
                f"the checkpoint's LR scheduler has {len(values)} parameter group(s) with "
                f"different {key} {values}; this optimizer has {num_groups} group(s)"
            )
        fitted[key] = [copy.deepcopy(values[0]) for _ in range(num_groups)]
    return fitted


def apply_schedule(
    engine: Any,
    *,
    param_groups: Sequence[dict[str, Any]] | None,
    lr_scheduler: dict[str, Any] | None,
) -> None:
    """Restore the optimizer's hyperparameters and the learning-rate schedule of another layout.

    Group i means the same on every layout (plait's factory puts the decayed group first and
    adds the undecayed one only if it has parameters), but under ZeRO a rank whose shard holds no
    vector has one group fewer than the layout that saved.
    """
    if param_groups is not None:
        for saved, group in zip(param_groups, engine.optimizer.param_groups, strict=False):
            group.update(saved)
    if engine.lr_scheduler is not None and lr_scheduler is not None:
        fitted = fit_scheduler_state(lr_scheduler, len(engine.optimizer.param_groups))
        engine.lr_scheduler.load_state_dict(fitted)
        # The scheduler's state does not include the optimizer's current lr: set it.
        for group, lr in zip(
            engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr(), strict=False
        ):
            group["lr"] = lr
