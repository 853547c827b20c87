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

Sharded data parallelism, one optimizer step (`sharded_step_bytes`, `sharded_step_inter_node`).
ZeRO-3 all-gathers the parameters twice per micro-batch (forward, backward) and reduce-scatters
the gradients once, over its shard group. Flat ZeRO-3 shards over all `n = m·k` ranks, so every
micro-batch pays three ring ops across the nodes. HSDP (`parallel.dp_shard = k`) keeps those
three inside a node and adds, once per step, an all-reduce of each rank's gradient shard
(`B/k`) over its replica group (the `m` ranks of the same local index, one per node). For a
model of `B` bytes and `M` micro-batches, cross-node bytes per step, summed over the ranks:

    flat ZeRO-3 (ring)       M · 3 · m·(n−1)/n · B      (the ring crosses nodes on m hops)
    ZeRO-3, hierarchical     M · 3 · (m−1)·B            (each rank sends (m−1)/n·B across per op)
    HSDP                     n · 2·(m−1)/m · B/k = 2·(m−1)·B, independent of M

On 2 nodes × 2: flat `4.5·B·M`, hierarchical `3·B·M`, HSDP `2·B`: with 4 micro-batches `18·B`,
`12·B` and still `2·B`. (ZeRO-3 keeps the root unit and the last block gathered from forward to
backward, so its second all-gather is smaller than `B` by those units: the formulas per op
below count what it really gathers.)

ZeRO-1/2 under HSDP reduce their buckets inside the shard group every micro-batch and cross nodes
only in the replica exchange once per step (`replica_step_bytes`): each rank's gradient chunk of
`c = ⌈P/k⌉` elements (P the padded bucket) is all-reduced over its `m` replicas, `2·(m−1)·⌈c/m⌉`
elements. With `zero.shard_optimizer_across_replicas` the chunk is reduce-scattered over the
replicas instead (`(m−1)·⌈c/m⌉`) and, after the optimizer step, the updated sub-chunks all-gathered
back (`(m−1)·⌈c/m⌉`): the same bytes, so both are `2·(m−1)·B` per step summed over the ranks,
independent of M, while the optimizer state per rank shrinks `m`-fold.

ZeRO++ on hierarchical ZeRO-3: hpZ (`zero.secondary_shard`) gathers backward's parameters inside
the node, leaving `2·M·(m−1)·B` across; qwZ and qgZ send each across hop's chunk of `c` elements
as `encoded_bytes(c)` instead of `4·c` (≈ ¼ for int8, ⅛ for int4 with blocks of 256):
`encoded_hierarchical_bytes` counts one such op for one rank, `(m−1)·encoded_bytes(⌈N/n⌉)` across
and the unencoded op's `(k−1)·⌈N/k⌉·itemsize` inside.
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
    "encoded_bytes",
    "encoded_hierarchical_bytes",
    "flat_bytes",
    "hierarchical_bytes",
    "op_link_bytes",
    "point_to_point",
    "replica_step_bytes",
    "request_numel",
    "request_peer_bytes",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_broadcast",
    "ring_reduce_scatter",
    "sharded_step_bytes",
    "sharded_step_inter_node",
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


def _ceil(a: int, b: int) -> int:
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
    return _to(host_map, rank, _right(group, rank), 2 * (n - 1) * _ceil(numel, n) * itemsize)


def ring_reduce_scatter(
    group: Sequence[int], rank: int, numel: int, itemsize: int, host_map: HostMap
) -> LinkBytes:
    """`(n−1)·⌈N/n⌉·itemsize` to the right neighbour; `numel` is the input's (all chunks)."""
    n = len(group)
    if n < 2:
        return NONE
    return _to(host_map, rank, _right(group, rank), (n - 1) * _ceil(numel, n) * itemsize)


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
        shard = _ceil(numel, k)
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


# -- sharded data parallelism, one optimizer step ---------------------------------------------


def sharded_step_bytes(
    rank: int,
    *,
    shard_group: Sequence[int],
    replica_group: Sequence[int],
    host_map: HostMap,
    gathers: Sequence[int],
    reductions: Sequence[int],
    itemsize: int,
    microbatches: int = 1,
    algorithm: str = "torch",
) -> LinkBytes:
    """What `rank` sends in one step of ZeRO-3 / HSDP: every micro-batch all-gathers each numel
    of `gathers` (outputs) and reduce-scatters each numel of `reductions` (inputs) over
    `shard_group`; once per step each reduced shard (`numel / len(shard_group)`) is
    all-reduced over `replica_group` (one rank for flat ZeRO-3: nothing)."""

    def ops(op: str, group: Sequence[int], numels: Sequence[int]) -> LinkBytes:
        total = NONE
        for numel in numels:
            sent = op_link_bytes(
                op, group, rank, numel=numel, itemsize=itemsize, host_map=host_map,
                algorithm=algorithm,
            )  # fmt: skip
            total += sent if sent is not None else NONE
        return total

    per_microbatch = ops("all_gather", shard_group, gathers) + ops(
        "reduce_scatter", shard_group, reductions
    )
    shards = [numel // len(shard_group) for numel in reductions]
    across = ops("all_reduce", replica_group, shards)
    return LinkBytes(
        microbatches * per_microbatch.intra_node + across.intra_node,
        microbatches * per_microbatch.inter_node + across.inter_node,
    )


def replica_step_bytes(
    rank: int,
    *,
    replica_group: Sequence[int],
    host_map: HostMap,
    chunks: Sequence[int],
    itemsize: int,
    optimizer_across_replicas: bool,
    algorithm: str = "torch",
) -> LinkBytes:
    """What `rank` sends over its HSDP replica group once per step of ZeRO-1/2, for gradient
    chunks of `chunks` elements (one per bucket, the shard group's chunk): each all-reduced,
    or, with the optimizer state sharded across the replicas, reduce-scattered and the
    updated parameter chunk all-gathered back (module doc)."""
    ops = ("reduce_scatter", "all_gather") if optimizer_across_replicas else ("all_reduce",)
    total = NONE
    for numel in chunks:
        for op in ops:
            sent = op_link_bytes(
                op, replica_group, rank, numel=numel, itemsize=itemsize, host_map=host_map,
                algorithm=algorithm,
            )  # fmt: skip
            total += sent if sent is not None else NONE
    return total


def encoded_bytes(numel: int, *, bits: int, block: int) -> int:
    """Bytes of `numel` values under a block-wise integer codec (ZeRO++'s qwZ / qgZ,
    `plait.plugins.collectives.codecs`): the padded payload of `bits` per element and one fp32
    scale per block, `⌈N/block⌉·block·bits/8 + 4·⌈N/block⌉`. The hierarchical all-gather and
    reduce-scatter with a codec send `(m−1)` such encodings of a rank's chunk across nodes,
    where unencoded they send `(m−1)·chunk·itemsize`."""
    blocks = _ceil(numel, block)
    return blocks * block * bits // 8 + 4 * blocks


def encoded_hierarchical_bytes(
    op: str,
    hierarchy: Hierarchy,
    rank: int,
    *,
    numel: int,
    itemsize: int,
    bits: int,
    block: int,
    host_map: HostMap,
) -> LinkBytes:
    """The hierarchical all-gather or reduce-scatter of `numel` elements (the whole tensor) with
    a codec of `bits` per element on its across step (`plait.plugins.collectives.hierarchical`):
    inside, the unencoded op's step, `(k−1)·⌈N/k⌉·itemsize`; across, `(m−1)` encodings of this
    rank's chunk of `c = ⌈N/n⌉` elements, `encoded_bytes(c)` each — the all-gather's ring
    all-gathers of the payloads and the scales, or the reduce-scatter's all-to-all that sends
    each other node's owner its encoded partial sum."""
    if op not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"a codec encodes an all_gather or a reduce_scatter, not {op!r}")
    intra, cross = hierarchy.intra_of(rank), hierarchy.cross_of(rank)
    m = len(cross)
    encoded = encoded_bytes(_ceil(numel, len(hierarchy.group_ranks)), bits=bits, block=block)
    inside = ring_reduce_scatter(intra, rank, numel, itemsize, host_map)
    if op == "all_gather":
        return inside + ring_all_gather(cross, rank, m * encoded, 1, host_map)
    return inside + all_to_all(cross, rank, [encoded] * m, host_map)


def sharded_step_inter_node(
    model_bytes: float, *, nodes: int, ranks_per_node: int, microbatches: int, layout: str
) -> float:
    """Cross-node bytes of one step summed over all ranks, for a model of `model_bytes` whose
    every tensor divides evenly (module doc): `layout` is "flat" (ZeRO-3, ring over every
    rank), "hierarchical" (ZeRO-3 with hierarchical collectives) or "hsdp" (dp_shard = the
    ranks of a node). Two all-gathers and one reduce-scatter of the whole model per
    micro-batch."""
    m, k = nodes, ranks_per_node
    n = m * k
    if layout == FLAT:
        return microbatches * 3 * m * (n - 1) / n * model_bytes
    if layout == HIERARCHICAL:
        return microbatches * 3 * (m - 1) * model_bytes
    if layout == "hsdp":
        return n * 2 * (m - 1) / m * model_bytes / k
    raise ValueError(f"layout must be flat, hierarchical or hsdp, got {layout!r}")
