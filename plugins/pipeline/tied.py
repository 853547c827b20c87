"""Parameters that pipeline stages on different ranks share (tied input and output embeddings).

GPT-2 (and any model with `tie_word_embeddings`) uses one matrix as its token embedding on the
first stage and as its output projection on the last. Each of those ranks holds the matrix and
accumulates the gradient of its own use; the runtime sums the two over the pipeline ranks at
`SyncGradients` (Megatron-LM's embedding all-reduce), so both copies take the same step.

That sum must see the final local gradient and nothing else may be reducing it at the same
time, so it is supported without data parallelism (a data-parallel runtime reduces gradients
asynchronously during backward). With more than two pipeline ranks the tied matrix is held by
two of them, which the global gradient norm cannot express, so clipping is refused there.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from plait.core.errors import ConfigError
from plait.core.sharding import ShardContext
from plait.plugins.pipeline.split import StagePlan


def tied_parameters(
    model: nn.Module,
    plan: StagePlan,
    stages: Mapping[int, nn.Module],
    *,
    rank: int,
    context: ShardContext,
) -> list[tuple[torch.Size, nn.Parameter | None]]:
    """(shape, this rank's copy or None) of each parameter held by several pipeline ranks, in
    the full model's order (the same on every rank)."""
    holders: dict[int, set[int]] = {}
    for chunk in plan.chunks:
        for p in stages[chunk.stage].parameters():
            holders.setdefault(id(p), set()).add(chunk.rank)
    shared = [(name, p) for name, p in model.named_parameters() if len(holders.get(id(p), ())) > 1]
    if not shared:
        return []
    names = [name for name, _ in shared]
    parallel = context.config.parallel
    if context.mesh.size("dp") > 1 or parallel.dp_strategy != "ddp":
        raise ConfigError(
            f"{type(model).__name__} ties {names} across pipeline stages; that is supported "
            f"with parallel.dp = 1 and dp_strategy 'ddp' only (got dp = "
            f"{context.mesh.size('dp')}, dp_strategy {parallel.dp_strategy!r}); untie them "
            "(e.g. config.tie_word_embeddings = False) or train without data parallelism"
        )
    if plan.num_stages > 2 and context.config.train.max_grad_norm > 0:
        raise ConfigError(
            f"{type(model).__name__} ties {names} across pipeline stages, which the global "
            "gradient norm counts exactly with parallel.pp = 2 only; set train.max_grad_norm "
            "= 0 or parallel.pp = 2"
        )
    mine = {id(p) for c in plan.for_rank(rank) for p in stages[c.stage].parameters()}
    return [(p.shape, p if id(p) in mine else None) for _, p in shared]
