"""Hierarchical collectives: inside the node, across nodes, inside again.

Selected with `[comm] algorithm = "hierarchical"`, and by default when the host map has several
nodes with several ranks each (`plait.core.comm_algorithms.chosen_algorithm`). For a group
spread over `m` nodes with `k` ranks each (`plait.core.host_map.Hierarchy`):

* all-reduce = reduce-scatter inside the node → all-reduce across nodes, among the ranks with
  the same local index, on the `1/k` shard each holds → all-gather inside the node;
* reduce-scatter = reduce-scatter inside (chunks laid out so local index `p` keeps the chunks of
  cross-node group `p`) → reduce-scatter across;
* all-gather = the reduce-scatter's steps backwards.

Each rank then sends `2·(m−1)/(m·k)` of an all-reduce's bytes across nodes, where a flat ring
pushes `2·(n−1)/n` over each of its node-crossing hops (`plait.core.link_bytes` has the
formulas). A tensor whose length does not divide by `k` is padded with zeros to a multiple of
`k` (padding only ever meets padding, so max and min are unaffected) and cut back after.
Sums are sums of the same terms as the flat op's; with integer-valued floats they are equal
to the bit. `avg` sums and divides once, by the group's size.

Groups with no hierarchy (one node, one rank per node, unequal nodes) and groups whose
sub-groups were not created at configure time are not taken over: their ops are the backend's
flat ops, which is what a hierarchy of one level is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.core.comm import Comm, Group
from plait.core.host_map import Hierarchy, HostMap

__all__ = ["HierarchyGroups", "create_hierarchies", "hierarchical_all_gather",
           "hierarchical_all_reduce", "hierarchical_reduce_scatter"]  # fmt: skip


@dataclass(frozen=True, slots=True)
class HierarchyGroups:
    """This rank's two sub-groups of one hierarchical group, and the hierarchy itself."""

    hierarchy: Hierarchy
    intra: Group  # this rank's node
    cross: Group  # the ranks at this rank's local index on every node

    @property
    def size(self) -> int:
        return len(self.hierarchy.group_ranks)


def create_hierarchies(
    rank_sets: Iterable[Sequence[int]], host_map: HostMap
) -> dict[tuple[int, ...], HierarchyGroups]:
    """Create the intra- and cross-node process groups of every rank set that has a hierarchy.

    Collective over the world: every rank calls it with the same rank sets in the same order
    (creating a process group is), and creates every sub-group, its own or not."""
    me = dist.get_rank()
    created: dict[tuple[int, ...], Group] = {}
    out: dict[tuple[int, ...], HierarchyGroups] = {}
    for ranks in (tuple(r) for r in rank_sets):
        hierarchy = host_map.hierarchy(ranks)
        if hierarchy is None or ranks in out:
            continue
        for sub in (*hierarchy.intra, *hierarchy.cross):
            if sub not in created:
                name = f"hierarchical[{','.join(map(str, sub))}]"
                created[sub] = Group(name=name, ranks=sub, process_group=dist.new_group(list(sub)))
        if me in ranks:
            out[ranks] = HierarchyGroups(
                hierarchy, created[hierarchy.intra_of(me)], created[hierarchy.cross_of(me)]
            )
    return out


def _sum_op(reduce_op: str) -> str:
    # avg is a sum divided once at the end, by the whole group's size.
    return "sum" if reduce_op == "avg" else reduce_op


def hierarchical_all_reduce(
    comm: Comm, tensor: torch.Tensor, *, groups: HierarchyGroups, reduce_op: str, purpose: str
) -> None:
    """All-reduce `tensor` in place: reduce-scatter inside, all-reduce across, all-gather."""
    numel = tensor.numel()
    if numel == 0:
        return
    k = groups.hierarchy.ranks_per_node
    shard = -(-numel // k)
    padded = tensor.new_zeros(k * shard)
    padded[:numel].copy_(tensor.reshape(-1))
    part = tensor.new_empty(shard)
    op = _sum_op(reduce_op)
    comm.reduce_scatter(part, padded, group=groups.intra, op=op, purpose=purpose)
    comm.all_reduce(part, group=groups.cross, op=op, purpose=purpose)
    if reduce_op == "avg":
        part.div_(groups.size)
    comm.all_gather(padded, part, group=groups.intra, purpose=purpose)
    tensor.copy_(padded[:numel].view(tensor.shape))


def hierarchical_reduce_scatter(
    comm: Comm,
    output: torch.Tensor,
    source: torch.Tensor,
    *,
    groups: HierarchyGroups,
    reduce_op: str,
    purpose: str,
) -> None:
    """`output` gets this rank's chunk (group order) of the reduction of `source`."""
    n, m = groups.size, groups.hierarchy.nodes
    chunk = output.numel()
    if chunk == 0:
        return
    order = torch.tensor(groups.hierarchy.chunk_order(), device=source.device)
    arranged = source.reshape(n, chunk).index_select(0, order).reshape(-1)
    middle = output.new_empty(m * chunk)
    op = _sum_op(reduce_op)
    comm.reduce_scatter(middle, arranged, group=groups.intra, op=op, purpose=purpose)
    mine = output.new_empty(chunk)
    comm.reduce_scatter(mine, middle, group=groups.cross, op=op, purpose=purpose)
    if reduce_op == "avg":
        mine.div_(n)
    output.copy_(mine.view(output.shape))


def hierarchical_all_gather(
    comm: Comm, output: torch.Tensor, source: torch.Tensor, *, groups: HierarchyGroups, purpose: str
) -> None:
    """`output` gets every rank's `source`, in group order: across, then inside."""
    n, m = groups.size, groups.hierarchy.nodes
    chunk = source.numel()
    if chunk == 0:
        return
    middle = source.new_empty(m * chunk)
    comm.all_gather(middle, source.reshape(-1), group=groups.cross, purpose=purpose)
    arranged = source.new_empty(n * chunk)
    comm.all_gather(arranged, middle, group=groups.intra, purpose=purpose)
    order = torch.tensor(groups.hierarchy.chunk_order(), device=source.device)
    result = source.new_empty(n, chunk)
    result.index_copy_(0, order, arranged.view(n, chunk))
    output.copy_(result.view(output.shape))
