"""Global gradient norm and clipping across every rank, whatever the parallel layout.

A strategy marks each parameter with the mesh axes its tensor is sharded over
(`mark_sharded(p, ("tp",))`; a pipeline stage marks its parameters with `("pp",)`). Then each
rank adds `‖g‖² · ∏ size(sharded axes) / world_size` and one scalar all-reduce over the world
gives the exact global `‖g‖²`: a shard is held by `world / ∏ size(sharded axes)` ranks, so each
distinct shard is counted exactly once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from plait.core.comm import Comm, world_group
from plait.core.comm_algorithms import GRAD_NORM
from plait.core.mesh import Mesh

SHARDED_AXES_ATTR = "_plait_sharded_axes"


def mark_sharded(param: nn.Parameter, axes: Iterable[str]) -> None:
    """Record that `param` holds a shard over `axes` (added to any axes already recorded)."""
    existing = getattr(param, SHARDED_AXES_ATTR, ())
    setattr(param, SHARDED_AXES_ATTR, tuple(dict.fromkeys((*existing, *axes))))


def sharded_axes(param: nn.Parameter) -> tuple[str, ...]:
    return getattr(param, SHARDED_AXES_ATTR, ())


def global_grad_norm(params: Iterable[nn.Parameter], *, mesh: Mesh, comm: Comm) -> torch.Tensor:
    """The L2 norm of all gradients of the model, identical on every rank.

    One `torch._foreach_norm` per group of parameters that share a shard weight (one group
    without sharding), as torch's `clip_grad_norm_`: a handful of kernel launches however many
    parameters the model has, not a few per parameter.
    """
    params = [p for p in params if p.grad is not None]
    any_sharded = any(sharded_axes(p) for p in params)
    device = params[0].grad.device if params else mesh.device
    by_weight: dict[tuple[float, torch.device], list[torch.Tensor]] = {}
    for p in params:
        weight = 1.0
        if any_sharded:
            shards = 1
            for axis in sharded_axes(p):
                shards *= mesh.size(axis)
            weight = shards / mesh.world_size
        by_weight.setdefault((weight, p.grad.device), []).append(p.grad)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (weight, _device), grads in by_weight.items():
        with torch.no_grad():  # gradients are plain tensors: no per-gradient detach needed
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        squares = torch.linalg.vector_norm(torch.stack(norms)).square()
        total += (squares * weight if weight != 1.0 else squares).to(device)
    if any_sharded and mesh.world_size > 1:
        comm.all_reduce(total, group=world_group(), op="sum", purpose=GRAD_NORM)
    return total.sqrt()


def clip_grads_(params: Iterable[nn.Parameter], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients in place so their global norm is at most `max_norm`."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))
