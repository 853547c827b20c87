"""Bytes per link class: how many bytes of a collective one rank sends inside its node and
across nodes, with the formulas written down.

Every formula counts the bytes **this rank sends** (what it receives is another rank's send),
for a group `G = (g_0 … g_{n-1})` in group order, `B` bytes of payload (defined per op below),
`itemsize` bytes per element and the host map (`plait.core.host_map`). `⌈x/y⌉` is integer
ceiling division: a tensor whose length does not divide is counted in whole, padded chunks
(the hierarchical algorithm pads for real; for the backend it is the model's rounding, exact
whenever the length divides).

Flat: a ring in group order (NCCL's ring, plait's ring algorithm). Rank `g_i` sends only to
its right neighbour `g_{i+1 mod n}`, so all its bytes travel one link: inside the node when the
neighbour shares it, across otherwise. Of the ring's `n` hops, those joining two nodes carry
the cross-node bytes; with `N` numel and `c = ⌈N/n⌉` elements per chunk:

    all-reduce (B = the tensor)           2·(n−1)·c·itemsize   ≈ 2·(n−1)/n·B
    reduce-scatter (B = the input)          (n−1)·c·itemsize   ≈ (n−1)/n·B
    all-gather (B = the output)             (n−1)·c·itemsize   ≈ (n−1)/n·B
    broadcast (B = the tensor)            B, unless g_i is the last of the chain from the root
    all-to-all                            each block to its own rank, classified by that rank
    send (B = the tensor) / recv          B to the peer / 0
    barrier                               0

Hierarchical (`plait.plugins.collectives.hierarchical`), on a group spread over `m` nodes with
`k` ranks each (`n = m·k`): the intra-node groups hold each node's ranks, the cross-node group
`j` the ranks at local index `j`. Each step is a flat op on its sub-group, so its bytes are the
flat formulas above on that sub-group, and they add up:

    all-reduce:      reduce-scatter inside (s = ⌈N/k⌉)    intra (k−1)·s·itemsize
                     all-reduce across on s elements       inter 2·(m−1)·⌈s/m⌉·itemsize
                     all-gather inside                     intra (k−1)·s·itemsize
    reduce-scatter:  inside on N, then across on N/k      intra (k−1)·⌈N/k⌉, inter (m−1)·⌈N/n⌉
    all-gather:      across to N/k, then inside to N      inter (m−1)·⌈N/n⌉, intra (k−1)·⌈N/k⌉

Worked example, 2 nodes × 2 ranks, group (0, 1, 2, 3), all-reduce of `B` bytes (N divisible
by 4): flat, every rank sends `2·3/4·B = 1.5·B`; ranks 1 and 3 send it across (their right
neighbours 2 and 0 are on the other node), ranks 0 and 2 inside: `3·B` cross nodes per step,
`0.75·B` per rank on average, `1.5·B` on each of the two busiest links. Hierarchical, every
rank sends `B/2` inside (reduce-scatter) + `(B/2)·2·(2−1)/2 = B/2` across + `B/2` inside
(all-gather): `B` inside and `B/2` across per rank, `2·B` cross nodes per step, and no link
carries more than `B/2` of it. In general the busiest cross-node link carries `2·(n−1)/n·B`
flat and `2·(m−1)/(m·k)·B` hierarchical: `k` times less, at the price of `2·(k−1)/k·B` more
bytes inside each node.

What whole steps of sharded data parallelism send, and ZeRO++'s encoded bytes, are
`plait.plugins.collectives.step_bytes`, from these formulas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.core.host_map import Hierarchy, HostMap

if TYPE_CHECKING:
    from plait.core.records import CommRequest

__all__ = [
    "ALGORITHM_MODELS",
    "FLAT",
    "HIERARCHICAL",
    "LinkBytes",
    "all_to_all",
    "flat_bytes",
    "hierarchical_bytes",
    "op_link_bytes",
    "point_to_point",
    "request_numel",
    "request_peer_bytes",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_broadcast",
    "ring_reduce_scatter",
]

FLAT = "flat"
HIERARCHICAL = "hierarchical"
# The byte model of each algorithm that carries ops out, by the name it reports them under
# (`plait.core.comm_algorithms.CARRIED_BY`): the backend and plait's ring are rings in group
# order. An algorithm not listed has no model: its ops' spans carry no link bytes (its
# sub-ops', carried by the backend, do).
ALGORITHM_MODELS = {"torch": FLAT, "ring": FLAT, HIERARCHICAL: HIERARCHICAL}


@dataclass(frozen=True, slots=True)
class LinkBytes:
    """Bytes one rank sent inside its node and across nodes."""

    intra_node: int = 0
    inter_node: int = 0

    def __add__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.intra_node + other.intra_node, self.inter_node + other.inter_node)

    @property
    def total(self) -> int:
        return self.intra_node + self.inter_node


NONE = LinkBytes()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _to(host_map: HostMap, rank: int, peer: int, nbytes: int) -> LinkBytes:
    if host_map.same_node(rank, peer):
        return LinkBytes(intra_node=nbytes)
    return LinkBytes(inter_node=nbytes)


def _right(group: Sequence[int], rank: int) -> int:
    return group[(group.index(rank) + 1) % len(group)]


# -- flat: a ring in group order --------------------------------------------------------------


def ring_all_reduce(
    group: Sequence[int], rank: int, numel: int, itemsize: int, host_map: HostMap
) -> LinkBytes:
    """`2·(n−1)·⌈N/n⌉·itemsize` to the right neighbour."""
    n = len(group)
    if n < 2:
        return NONE
    return _to(host_map, rank, _right(group, rank), 2 * (n - 1) * ceil_div(numel, n) * itemsize)


def ring_reduce_scatter(
    group: Sequence[int], rank: int, numel: int, itemsize: int, host_map: HostMap
) -> LinkBytes:
    """`(n−1)·⌈N/n⌉·itemsize` to the right neighbour; `numel` is the input's (all chunks)."""
    n = len(group)
    if n < 2:
        return NONE
    return _to(host_map, rank, _right(group, rank), (n - 1) * ceil_div(numel, n) * itemsize)


def ring_all_gather(
    group: Sequence[int], rank: int, numel: int, itemsize: int, host_map: HostMap
) -> LinkBytes:
    """`(n−1)·⌈N/n⌉·itemsize` to the right neighbour; `numel` is the output's (all chunks)."""
    return ring_reduce_scatter(group, rank, numel, itemsize, host_map)


def ring_broadcast(
    group: Sequence[int], rank: int, root: int, nbytes: int, host_map: HostMap
) -> LinkBytes:
    """A chain from `root` in ring order: every rank but the chain's last forwards `B`."""
    n = len(group)
    if n < 2 or root not in group:
        return NONE
    position = (group.index(rank) - group.index(root)) % n
    return _to(host_map, rank, _right(group, rank), nbytes) if position < n - 1 else NONE


def all_to_all(
    group: Sequence[int], rank: int, bytes_per_peer: Sequence[int], host_map: HostMap
) -> LinkBytes:
    """Block `j` (`bytes_per_peer[j]`) goes straight to `group[j]`; this rank's own stays."""
    total = NONE
    for peer, nbytes in zip(group, bytes_per_peer, strict=True):
        if peer != rank and nbytes:
            total += _to(host_map, rank, peer, nbytes)
    return total


def point_to_point(rank: int, peer: int, nbytes: int, host_map: HostMap) -> LinkBytes:
    """A send of `B` to `peer` (a receive sends nothing: pass 0)."""
    return _to(host_map, rank, peer, nbytes) if peer != rank else NONE


def flat_bytes(
    op: str,
    group: Sequence[int],
    rank: int,
    *,
    numel: int,
    itemsize: int,
    host_map: HostMap,
    peer: int | None = None,
    bytes_per_peer: Sequence[int] | None = None,
) -> LinkBytes:
    """The flat model of `op`. `numel`: all-reduce and broadcast the tensor's, reduce-scatter
    the input's, all-gather the output's, send the tensor's."""
    if rank not in group:
        return NONE
    match op:
        case "all_reduce":
            return ring_all_reduce(group, rank, numel, itemsize, host_map)
        case "reduce_scatter":
            return ring_reduce_scatter(group, rank, numel, itemsize, host_map)
        case "all_gather":
            return ring_all_gather(group, rank, numel, itemsize, host_map)
        case "broadcast":
            root = group[0] if peer is None else peer
            return ring_broadcast(group, rank, root, numel * itemsize, host_map)
        case "all_to_all":
            if bytes_per_peer is None:
                share = numel // len(group) * itemsize
                bytes_per_peer = [share] * len(group)
            return all_to_all(group, rank, bytes_per_peer, host_map)
        case "send":
            return NONE if peer is None else point_to_point(rank, peer, numel * itemsize, host_map)
    return NONE  # recv, barrier


# -- hierarchical: inside, across, inside ----------------------------------------------------


def hierarchical_bytes(
    op: str, hierarchy: Hierarchy, rank: int, *, numel: int, itemsize: int, host_map: HostMap
) -> LinkBytes:
    """The hierarchical algorithm's steps, each a flat op on its sub-group (module doc)."""
    intra, cross = hierarchy.intra_of(rank), hierarchy.cross_of(rank)
    k = hierarchy.ranks_per_node
    if op == "all_reduce":
        shard = ceil_div(numel, k)
        return (
            ring_reduce_scatter(intra, rank, k * shard, itemsize, host_map)
            + ring_all_reduce(cross, rank, shard, itemsize, host_map)
            + ring_all_gather(intra, rank, k * shard, itemsize, host_map)
        )
    if op in ("reduce_scatter", "all_gather"):
        # N = n·c (one chunk per group rank): N inside (each node rank keeps N/k = m·c), then
        # N/k across; an all-gather runs the same two steps backwards and sends as much.
        return ring_reduce_scatter(intra, rank, numel, itemsize, host_map) + ring_reduce_scatter(
            cross, rank, numel // k, itemsize, host_map
        )
    return flat_bytes(
        op, hierarchy.group_ranks, rank, numel=numel, itemsize=itemsize, host_map=host_map
    )


# -- for an op as issued ------------------------------------------------------------------------


def op_link_bytes(
    op: str,
    group: Sequence[int],
    rank: int,
    *,
    numel: int,
    itemsize: int,
    host_map: HostMap,
    algorithm: str,
    peer: int | None = None,
    bytes_per_peer: Sequence[int] | None = None,
) -> LinkBytes | None:
    """The bytes `op` sends under the model of the algorithm that carried it out (its
    `CARRIED_BY` name), or None when that algorithm has no model. `numel` as `flat_bytes`."""
    model = ALGORITHM_MODELS.get(algorithm)
    if model is None or any(r >= host_map.world_size for r in group):
        return None
    if model == HIERARCHICAL and op in ("all_reduce", "reduce_scatter", "all_gather"):
        hierarchy = host_map.hierarchy(group)
        if hierarchy is not None and rank in group:
            return hierarchical_bytes(
                op, hierarchy, rank, numel=numel, itemsize=itemsize, host_map=host_map
            )
    return flat_bytes(
        op, group, rank, numel=numel, itemsize=itemsize, host_map=host_map, peer=peer,
        bytes_per_peer=bytes_per_peer,
    )  # fmt: skip


def request_numel(request: CommRequest) -> int:
    """The `numel` the formulas take for a request (the whole tensor of the op: module doc)."""
    tensors = request.tensors
    if not tensors:
        return 0
    if request.op == "all_gather":
        return tensors[0].numel()  # the output: every rank's chunk
    if request.op in ("reduce_scatter", "all_to_all"):
        return tensors[1].numel()  # the input
    return tensors[0].numel()


def request_peer_bytes(request: CommRequest) -> tuple[int, ...] | None:
    """An all-to-all with split sizes: the bytes of each block this rank sends (else None)."""
    from plait.core.comm import INPUT_SPLIT_SIZES

    if request.op != "all_to_all":
        return None
    splits = request.attributes.get(INPUT_SPLIT_SIZES)
    if splits is None:
        return None
    source = request.tensors[1]
    row = source[0].numel() * source.element_size() if source.shape[0] else 0
    return tuple(int(s) * row for s in splits)
