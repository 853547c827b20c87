"""Which group a parameter's gradient is reduced, and its ZeRO shards gathered, over.

Without expert parallelism every parameter uses the data-parallel group (dp, times cp). With
`parallel.ep > 1` an expert parameter's slice is held only by the ranks with the same ep
coordinate, so its gradient is averaged and sharded over the expert-data-parallel group
(dp / ep ranks) while everything else stays on dp (Megatron-Core's and DeepSpeed-MoE's layout).
A ZeRO segment holds parameters of one group only, so the parameters are cut into runs of
consecutive parameters sharing a group before they are bucketed (stages 1 and 2) or a unit is
split into its dense part and its experts (stage 3).

The expert gradients arrive already scaled by 1 / ep (`plait.plugins.expert_parallel`), so the
average over the expert-dp group is the gradient of the global mean loss, as for DDP.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from plait.core.comm import Comm, Group
from plait.core.comm_algorithms import PARAM_SYNC
from plait.core.names import normalised_name
from plait.core.transforms import ExpertParallelism

NamedParameters = list[tuple[str, nn.Parameter]]


def group_of(name: str, default: Group, experts: ExpertParallelism | None) -> Group:
    """The gradient group of parameter `name` (as the model names it)."""
    if experts is None or experts.degree == 1:
        return default
    return experts.gradient_group(normalised_name(name), default)


def runs_by_group(
    named: Sequence[tuple[str, nn.Parameter]], default: Group, experts: ExpertParallelism | None
) -> list[tuple[Group, NamedParameters]]:
    """`named` cut into maximal runs of consecutive parameters with the same gradient group,
    in order (so buckets still complete roughly in backward order)."""
    runs: list[tuple[Group, NamedParameters]] = []
    for name, param in named:
        group = group_of(name, default, experts)
        if runs and runs[-1][0] == group:
            runs[-1][1].append((name, param))
        else:
            runs.append((group, [(name, param)]))
    return runs


def split_by_group(
    named: Sequence[tuple[str, nn.Parameter]], default: Group, experts: ExpertParallelism | None
) -> list[tuple[Group, NamedParameters]]:
    """`named` split by gradient group, the default group first (a stage 3 unit's dense part,
    then its experts); groups with no parameter are left out."""
    by_group: dict[Group, NamedParameters] = {default: []}
    for name, param in named:
        by_group.setdefault(group_of(name, default, experts), []).append((name, param))
    return [(group, params) for group, params in by_group.items() if params]


def broadcast_module(
    module: nn.Module, comm: Comm, group: Group, experts: ExpertParallelism | None = None
) -> None:
    """Copy the first rank's parameters and buffers to every rank of its group: an expert
    parameter over the expert-dp group (ranks of other ep coordinates hold other experts),
    everything else over `group`."""
    with torch.no_grad():
        named = [*module.named_parameters(), *module.named_buffers()]
        for name, tensor in named:
            source = group_of(name, group, experts)
            if source.size > 1:
                comm.broadcast(tensor.data, src=source.ranks[0], group=source, purpose=PARAM_SYNC)
