"""Bytes of whole steps of sharded data parallelism per link class, and ZeRO++'s encoded bytes:
the formulas the planner prices layouts with and the tests hold the collectives to, built from
the per-op formulas of the comm layer (`plait.core.link_bytes`, whose module doc defines the
notation: `m` nodes of `k` ranks, `n = m·k`, `B` bytes).

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

from plait.core.host_map import Hierarchy, HostMap
from plait.core.link_bytes import (
    FLAT,
    HIERARCHICAL,
    NONE,
    LinkBytes,
    all_to_all,
    ceil_div,
    op_link_bytes,
    ring_all_gather,
    ring_reduce_scatter,
)


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
    blocks = ceil_div(numel, block)
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
    encoded = encoded_bytes(ceil_div(numel, len(hierarchy.group_ranks)), bits=bits, block=block)
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
