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

With a codec (`plait.plugins.collectives.codecs`, ZeRO++'s qwZ and qgZ) the cross-node hop
alone is encoded: the all-gather's across step gathers each shard as block-wise integers and
scales and every rank decodes all of them (the owner too, so all ranks compute with the same
values); the reduce-scatter's across step becomes an all-to-all of each node's encoded partial
sums, decoded and added to this rank's own, unencoded, partial sum (an integer sum would
overflow and mix scales). Inside the node every step stays in the tensor's dtype.

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
from plait.plugins.collectives.codecs import Codec

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
    codec: Codec | None = None,
) -> None:
    """`output` gets this rank's chunk (group order) of the reduction of `source`; with a
    `codec` (sums only) the across step is an encoded all-to-all."""
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
    if codec is None:
        comm.reduce_scatter(mine, middle, group=groups.cross, op=op, purpose=purpose)
    else:
        if op != "sum":
            raise ValueError(f"a {codec.name} reduce-scatter sums or averages, not {reduce_op!r}")
        _encoded_reduce_scatter(
            comm, mine, middle, group=groups.cross, codec=codec, purpose=purpose
        )
    if reduce_op == "avg":
        mine.div_(n)
    output.copy_(mine.view(output.shape))


def hierarchical_all_gather(
    comm: Comm,
    output: torch.Tensor,
    source: torch.Tensor,
    *,
    groups: HierarchyGroups,
    purpose: str,
    codec: Codec | None = None,
) -> None:
    """`output` gets every rank's `source`, in group order: across (encoded with a `codec`),
    then inside."""
    n, m = groups.size, groups.hierarchy.nodes
    chunk = source.numel()
    if chunk == 0:
        return
    middle = source.new_empty(m * chunk)
    if codec is None:
        comm.all_gather(middle, source.reshape(-1), group=groups.cross, purpose=purpose)
    else:
        _encoded_all_gather(comm, middle, source, group=groups.cross, codec=codec, purpose=purpose)
    arranged = source.new_empty(n * chunk)
    comm.all_gather(arranged, middle, group=groups.intra, purpose=purpose)
    order = torch.tensor(groups.hierarchy.chunk_order(), device=source.device)
    result = source.new_empty(n, chunk)
    result.index_copy_(0, order, arranged.view(n, chunk))
    output.copy_(result.view(output.shape))


def _encoded_all_gather(
    comm: Comm, middle: torch.Tensor, source: torch.Tensor, *, group: Group, codec: Codec,
    purpose: str,
) -> None:  # fmt: skip
    """`middle` (m chunks) gets every cross-node rank's `source`, sent encoded, decoded."""
    m, chunk = group.size, source.numel()
    payload, scales = codec.encode(source)
    payloads = payload.new_empty(m * payload.numel())
    all_scales = scales.new_empty(m * scales.numel())
    comm.all_gather(payloads, payload, group=group, purpose=purpose)
    comm.all_gather(all_scales, scales, group=group, purpose=purpose)
    for j, (p, s) in enumerate(zip(payloads.chunk(m), all_scales.chunk(m), strict=True)):
        middle[j * chunk : (j + 1) * chunk].copy_(codec.decode(p, s, chunk))


def _encoded_reduce_scatter(
    comm: Comm, mine: torch.Tensor, middle: torch.Tensor, *, group: Group, codec: Codec,
    purpose: str,
) -> None:  # fmt: skip
    """`mine` gets the sum over the cross-node group of its chunk of `middle` (m chunks, one
    per cross-node rank): every other chunk is encoded and sent to its owner (all-to-all),
    which decodes what it received and adds it to its own chunk, which never left."""
    m, chunk = group.size, mine.numel()
    me = group.rank_of(dist.get_rank())
    pieces = middle.view(m, chunk)
    payload_numel, scale_numel = codec.payload_numel(chunk), codec.blocks(chunk)
    payloads = torch.zeros(m * payload_numel, dtype=torch.uint8, device=middle.device)
    scales = torch.zeros(m * scale_numel, dtype=torch.float32, device=middle.device)
    for j in range(m):
        if j != me:  # this rank's own chunk stays exact; its slot goes nowhere
            p, s = codec.encode(pieces[j])
            payloads[j * payload_numel : (j + 1) * payload_numel].copy_(p)
            scales[j * scale_numel : (j + 1) * scale_numel].copy_(s)
    received = torch.empty_like(payloads)
    received_scales = torch.empty_like(scales)
    comm.all_to_all(received, payloads, group=group, purpose=purpose)
    comm.all_to_all(received_scales, scales, group=group, purpose=purpose)
    total = pieces[me].float().clone()
    for j in range(m):
        if j != me:
            total += codec.decode(
                received[j * payload_numel : (j + 1) * payload_numel],
                received_scales[j * scale_numel : (j + 1) * scale_numel],
                chunk,
            )
    mine.copy_(total.view(mine.shape))
