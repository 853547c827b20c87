"""A layout's data-parallel (and pipeline) traffic per link class: bytes inside and across
nodes, and their time.

The bytes are `plait.core.link_bytes`' per-op formulas, applied to every rank of the groups
the mesh would build on the host map the job runs on (`HostMap.assumed`: node `i` holds ranks
`i·per_node …`); nothing here counts a byte itself. The groups follow the mesh's rank order
(pp, dp_replicate, dp_shard, cp, tp, tp fastest):

    gradient group   dp × cp            what DDP all-reduces and plain ZeRO shards over
    shard group      dp_shard × cp      what HSDP shards over (inside one node)
    replica group    dp_replicate       the ranks holding the same shard (across nodes)

What one optimizer step sends (`dp_transfers`), as plait's strategies issue it:

    DDP            all-reduce of the gradients over the gradient group
    ZeRO-1/2       reduce of the gradients (reduce-scatter, or all-reduce where the backend
                   lacks one) and all-gather of the updated parameters, over the shard group
    ZeRO-3         per micro-batch: two all-gathers of the parameters (forward, backward) and
                   a reduce of the gradients over the shard group
    HSDP (1/2/3)   once per step: all-reduce of each rank's gradient shard over its replicas
    hpZ (ZeRO-3)   backward's all-gather over the node group (the dp ranks of one node, from
                   the secondary shards) instead of the gradient group
    qwZ / qgZ      the hierarchical all-gather / reduce-scatter with its cross-node hop encoded
                   (`step_bytes.encoded_hierarchical_bytes`: `(m−1)·encoded_bytes(⌈N/n⌉)`
                   across per rank), the encode and decode priced at memory bandwidth
    pp             per micro-batch and chunk boundary: the activation to the next stage's
                   rank at the same place, its gradient back (`pipeline_cross_node`)

On 2 nodes × 2 with a model of `B` bytes this gives link_bytes' figures: DDP 3·B cross-node
bytes per step flat and 2·B hierarchical; ZeRO-3 4.5·B·M flat, 3·B·M hierarchical, 2·B HSDP,
2·B·M hierarchical with hpZ (docs/zero-plus-plus.md has the codecs' rows).

Time (`price_transfer`): every rank of a collective moves in lockstep, so an op takes as long
as its busiest rank needs to send its own bytes, each link class at its own α–β
(`comm_model`, measured by `plait plan calibrate` where a calibration exists): `intra / β_intra
+ inter / β_inter`, plus α for each of the op's steps on the link it crosses (a hierarchical op
pays the steps of its sub-ops: inside, across, inside).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from plait.core.host_map import SOURCE_ASSUMED, HostMap
from plait.core.link_bytes import (
    FLAT,
    HIERARCHICAL,
    LinkBytes,
    flat_bytes,
    hierarchical_bytes,
    point_to_point,
)
from plait.planner.comm_model import op_family, steps_and_volume
from plait.plugins.collectives.step_bytes import encoded_hierarchical_bytes

if TYPE_CHECKING:  # layouts asks this module which dp variants to offer: no import back
    from plait.planner.layouts import Job, Layout

GRADIENT, SHARD, REPLICA = "gradient", "shard", "replica"
NODE = "node"  # hpZ: the gradient group's ranks on one node (its secondary shards' group)
# Passes over each element the codecs make (`plait.plugins.collectives.codecs`, torch ops, each
# reading and writing fp32): encode = cast, pad, abs, amax, divide, round, clamp, narrow;
# decode = widen, scale, copy out.
CODEC_ENCODE_PASSES, CODEC_DECODE_PASSES = 8, 3
# The sub-ops of a hierarchical collective, each on the intra-node or the cross-node group
# (`plait.plugins.collectives.hierarchical`): the latency steps it pays.
HIERARCHICAL_SUB_OPS = {
    "all_reduce": (("reduce_scatter", "intra"), ("all_reduce", "inter"), ("all_gather", "intra")),
    "reduce_scatter": (("reduce_scatter", "intra"), ("reduce_scatter", "inter")),
    "all_gather": (("all_gather", "inter"), ("all_gather", "intra")),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """One data-parallel collective, issued `times` per optimizer step by every group of its
    kind; `numel` elements of `itemsize` bytes (link_bytes' `numel`: the whole tensor)."""

    op: str
    group: str  # GRADIENT, SHARD or REPLICA
    numel: tuple[int, ...]  # per pipeline stage
    itemsize: int
    times: int
    purpose: str  # "gradients", "parameters", "secondary" (hpZ's backward gathers), "replicas"
    codec_bits: int = 0  # ZeRO++: bits per element of the encoded cross-node hop (0: none)
    codec_block: int = 256


@dataclass(frozen=True, slots=True)
class GroupBytes:
    """What a collective sends on every group of its kind: the sum over the world's ranks, and
    the distinct per-rank figures (the busiest of them sets the op's time)."""

    total: LinkBytes
    per_rank: tuple[LinkBytes, ...]
    nodes: int  # the nodes the group spans
    hierarchical: bool  # carried out inside, across, inside


@dataclass(frozen=True, slots=True, kw_only=True)
class Traffic:
    """A layout's data-parallel traffic in one optimizer step, summed over the world's ranks."""

    intra_node: int
    inter_node: int
    inter_node_seconds: float  # the busiest rank's cross-node sends, unoverlapped


def job_host_map(job: Job) -> HostMap:
    """The host map a launch of `job` gets: `world / per_node` nodes of `per_node` ranks (one
    node when the world is smaller)."""
    return _host_map(*_nodes(job))


def _nodes(job: Job) -> tuple[int, int]:
    per_node = min(job.per_node, job.world)
    return job.world // per_node, per_node


@functools.cache
def _host_map(nodes: int, per_node: int) -> HostMap:
    return HostMap.assumed(nodes, per_node)


def _stage_groups(layout: Layout, kind: str, stage: int) -> list[tuple[int, ...]]:
    """Every group of `kind` on pipeline stage `stage`, ranks ascending (mesh order)."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    shard = layout.shard_degree
    replicas = dp // shard
    base = stage * dp * cp * tp

    def rank(replica: int, member: int, c: int, t: int) -> int:
        return base + (((replica * shard + member) * cp + c) * tp + t)

    if kind == GRADIENT:  # (dp, cp) flattened, dp-major
        return [
            tuple(base + (d * cp + c) * tp + t for d in range(dp) for c in range(cp))
            for t in range(tp)
        ]
    if kind == SHARD:
        return [
            tuple(rank(r, s, c, t) for s in range(shard) for c in range(cp))
            for r in range(replicas)
            for t in range(tp)
        ]
    return [
        tuple(rank(r, s, c, t) for r in range(replicas))
        for s in range(shard)
        for c in range(cp)
        for t in range(tp)
    ]


def _group_classes(
    nodes: int, per_node: int, mesh: Layout, kind: str, stage: int
) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The groups of `kind` on `stage` by where their ranks run, as (the node of each member in
    group order, nodes numbered from 0 as the group reaches them; how many groups run so).
    Groups placed alike send alike: a ring's hops and a hierarchy's sub-groups depend on which
    members share a node, nothing else. A stage's placements depend on where it starts inside
    a node only (node `i` holds ranks `i·per_node …`)."""
    offset = stage * mesh.dp * mesh.cp * mesh.tp % per_node if nodes > 1 else 0
    return _classes_at(per_node if nodes > 1 else 0, mesh, kind, offset)


@functools.lru_cache(maxsize=4096)
def _classes_at(
    per_node: int, mesh: Layout, kind: str, offset: int
) -> tuple[tuple[tuple[int, ...], int], ...]:
    classes: dict[tuple[int, ...], int] = {}
    for group in _stage_groups(mesh, kind, 0):
        number: dict[int, int] = {}
        if per_node:
            key = tuple(number.setdefault((offset + r) // per_node, len(number)) for r in group)
        else:
            key = (0,) * len(group)
        classes[key] = classes.get(key, 0) + 1
    return tuple(classes.items())


@functools.lru_cache(maxsize=1024)
def _placement(node_of_member: tuple[int, ...]) -> HostMap:
    """A group of `n` ranks placed as `node_of_member` says, as a world of its own (ranks
    0 … n−1): the same bytes per member as the group in the job's world, at a fraction of the
    lookups."""
    nodes = max(node_of_member) + 1
    return HostMap(node_of_member, ("",) * nodes, SOURCE_ASSUMED)


@functools.lru_cache(maxsize=16384)
def _group_bytes(
    op: str,
    node_of_member: tuple[int, ...],
    numel: int,
    itemsize: int,
    algorithm: str,
    codec_bits: int = 0,
    codec_block: int = 256,
) -> GroupBytes:
    """link_bytes' figure for every member of a group placed as `node_of_member`, flat or
    hierarchical as `op_link_bytes` dispatches it (with a codec on the hierarchical op's
    cross-node hop); `algorithm` NODE: the op on each member's node's part of the group."""
    host_map = _placement(node_of_member)
    group = range(len(node_of_member))
    hierarchy = None
    if algorithm in (HIERARCHICAL, NODE) and op in HIERARCHICAL_SUB_OPS:
        hierarchy = host_map.hierarchy(group)
    total = LinkBytes()
    seen: dict[LinkBytes, None] = {}
    for rank in group:
        if algorithm == NODE:
            inside = hierarchy.intra_of(rank) if hierarchy is not None else group
            sent = flat_bytes(op, inside, rank, numel=numel, itemsize=itemsize, host_map=host_map)
        elif hierarchy is not None and codec_bits:
            sent = encoded_hierarchical_bytes(
                op, hierarchy, rank, numel=numel, itemsize=itemsize, bits=codec_bits,
                block=codec_block, host_map=host_map,
            )  # fmt: skip
        elif hierarchy is not None:
            sent = hierarchical_bytes(
                op, hierarchy, rank, numel=numel, itemsize=itemsize, host_map=host_map
            )
        else:
            sent = flat_bytes(op, group, rank, numel=numel, itemsize=itemsize, host_map=host_map)
        total += sent
        seen[sent] = None
    return GroupBytes(
        total=total,
        per_rank=tuple(seen),
        nodes=host_map.num_nodes,
        hierarchical=hierarchy is not None and algorithm == HIERARCHICAL,
    )


def hierarchical_applies(layout: Layout, *, world: int, per_node: int) -> bool:
    """Whether the hierarchical algorithm changes the layout's data-parallel traffic on `world`
    ranks, `per_node` to a node: a group it reduces over spans several nodes holding several of
    its ranks each."""
    if layout.dp * layout.cp == 1 or world <= per_node:
        return False
    kinds = (GRADIENT,) if layout.shard_degree == layout.dp else (SHARD, REPLICA)
    mesh = _mesh_only(layout)
    return any(_spans_nodes_several_each(world // per_node, per_node, mesh, k) for k in kinds)


@functools.lru_cache(maxsize=4096)
def _spans_nodes_several_each(nodes: int, per_node: int, mesh: Layout, kind: str) -> bool:
    return any(
        _placement(placement).hierarchy(range(len(placement))) is not None
        for stage in range(mesh.pp)
        for placement, _ in _group_classes(nodes, per_node, mesh, kind, stage)
    )


def _mesh_only(layout: Layout) -> Layout:
    """The fields the groups depend on (a cache key shared by a mesh's variants)."""
    mesh = type(layout)  # the Layout class, without importing planner.layouts at run time
    return mesh(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, dp_shard=layout.dp_shard)


def secondary_group_size(job: Job, layout: Layout) -> int:
    """hpZ's node group: the dp ranks of one node in the layout's dp group (`k`), or the whole
    dp group when it has no hierarchy (one node, or one rank per node)."""
    nodes, per_node = _nodes(job)
    for placement, _ in _group_classes(nodes, per_node, _mesh_only(layout), GRADIENT, 0):
        hierarchy = _placement(placement).hierarchy(range(len(placement)))
        if hierarchy is not None:
            return hierarchy.ranks_per_node
    return layout.dp * layout.cp


def dp_transfers(job: Job, layout: Layout, stage_params: Sequence[float]) -> tuple[Transfer, ...]:
    """The data-parallel collectives of one optimizer step (module doc); `stage_params` are the
    parameters one rank of each pipeline stage holds."""
    if layout.dp * layout.cp == 1:
        return ()
    precision, device = job.precision, job.device
    numel = tuple(round(p) for p in stage_params)
    microbatches = max(job.global_batch // (layout.dp * layout.micro_batch), 1)
    grads, weights = precision.grad_bytes, precision.param_bytes
    if layout.zero == 0:
        return (Transfer(op="all_reduce", group=GRADIENT, numel=numel, itemsize=grads, times=1,
                         purpose="gradients"),)  # fmt: skip
    group = GRADIENT if layout.shard_degree == layout.dp else SHARD
    block = layout.quantize_block
    weight_bits, grad_bits = layout.weight_codec_bits, layout.gradient_codec_bits
    # ZeRO's gradient reduction: a reduce-scatter, or an all-reduce where the backend lacks one
    # (qgZ takes the reduce-scatter path on every backend)
    by_all_reduce = device.grads_reduce_by_all_reduce and not grad_bits
    grad_op = "all_reduce" if by_all_reduce else "reduce_scatter"
    reduce = Transfer(op=grad_op, group=group, numel=numel, itemsize=grads, times=microbatches,
                      purpose="gradients", codec_bits=grad_bits, codec_block=block)  # fmt: skip
    if layout.zero == 3:
        # forward gathers from the primary shards; backward from them too, or with hpZ from the
        # secondary shards inside the node
        gathers = microbatches if layout.secondary_shard else 2 * microbatches
        out = [
            Transfer(op="all_gather", group=group, numel=numel, itemsize=weights, times=gathers,
                     purpose="parameters", codec_bits=weight_bits, codec_block=block),
            reduce,
        ]  # fmt: skip
        if layout.secondary_shard:
            out.append(
                Transfer(op="all_gather", group=NODE, numel=numel, itemsize=weights,
                         times=microbatches, purpose="secondary")
            )  # fmt: skip
    else:
        out = [
            replace(reduce, times=1),
            Transfer(op="all_gather", group=group, numel=numel, itemsize=weights, times=1,
                     purpose="parameters"),
        ]  # fmt: skip
    if layout.shard_degree < layout.dp:
        shard = layout.shard_degree * layout.cp
        out.append(
            Transfer(op="all_reduce", group=REPLICA, numel=tuple(n // shard for n in numel),
                     itemsize=grads, times=1, purpose="replicas")
        )  # fmt: skip
    return tuple(out)


def transfer_bytes(job: Job, layout: Layout, transfer: Transfer) -> tuple[LinkBytes, GroupBytes]:
    """(bytes of one issue of `transfer` summed over the world, the figures of the group whose
    ranks send the most) — link_bytes' formulas on every group the mesh builds."""
    algorithm = NODE if transfer.group == NODE else layout.dp_algorithm
    return _transfer_bytes(*_nodes(job), _mesh_only(layout), algorithm, transfer)


@functools.lru_cache(maxsize=16384)
def _transfer_bytes(
    nodes: int, per_node: int, mesh: Layout, algorithm: str, transfer: Transfer
) -> tuple[LinkBytes, GroupBytes]:
    total = LinkBytes()
    busiest: GroupBytes | None = None
    kind = GRADIENT if transfer.group == NODE else transfer.group  # NODE: each node's part
    for stage in range(mesh.pp):
        numel = transfer.numel[min(stage, len(transfer.numel) - 1)]
        for placement, count in _group_classes(nodes, per_node, mesh, kind, stage):
            if len(placement) < 2:
                continue
            sent = _group_bytes(
                transfer.op, placement, numel, transfer.itemsize, algorithm,
                transfer.codec_bits, transfer.codec_block,
            )  # fmt: skip
            total += LinkBytes(count * sent.total.intra_node, count * sent.total.inter_node)
            most = max(b.total for b in sent.per_rank)
            if busiest is None or most > max(b.total for b in busiest.per_rank):
                busiest = sent
    if busiest is None:
        busiest = GroupBytes(
            total=LinkBytes(), per_rank=(LinkBytes(),), nodes=1, hierarchical=False
        )
    return total, busiest


@dataclass(frozen=True, slots=True, kw_only=True)
class PricedTransfer:
    """One issue of a transfer: its bytes summed over the world, and its time on the busiest
    rank (bandwidth, of which cross-node, and latency)."""

    transfer: Transfer
    total: LinkBytes
    bandwidth_seconds: float
    inter_node_seconds: float
    latency_seconds: float
    codec_seconds: float = 0.0  # encoding and decoding the cross-node hop, at memory bandwidth

    def seconds(self, fraction: float = 1.0) -> float:
        """`fraction` of the bytes (a last bucket) with all of the latency steps."""
        return fraction * (self.bandwidth_seconds + self.codec_seconds) + self.latency_seconds


def price_transfer(job: Job, layout: Layout, transfer: Transfer) -> PricedTransfer:
    total, busiest = transfer_bytes(job, layout, transfer)
    family = op_family(transfer.op)
    _, intra_beta = job.device.intra_node.for_op(family)
    _, inter_beta = job.device.inter_node.for_op(family)
    seconds = inter = 0.0
    for sent in busiest.per_rank:
        across = sent.inter_node / inter_beta
        time = sent.intra_node / intra_beta + across
        if time >= seconds:
            seconds, inter = time, across
    return PricedTransfer(
        transfer=transfer,
        total=total,
        bandwidth_seconds=seconds,
        inter_node_seconds=inter,
        latency_seconds=_latency(job, layout, transfer, busiest),
        codec_seconds=_codec_seconds(job, layout, transfer, busiest),
    )


def _codec_seconds(job: Job, layout: Layout, transfer: Transfer, busiest: GroupBytes) -> float:
    """One rank's encoding and decoding for an encoded op: the all-gather encodes its chunk
    and decodes all `m`; the reduce-scatter encodes the `m − 1` chunks it sends and decodes the
    `m − 1` it receives. Each pass reads and writes fp32 (`CODEC_*_PASSES`)."""
    if not transfer.codec_bits or not busiest.hierarchical:
        return 0.0
    m = busiest.nodes
    chunk = -(-max(transfer.numel) // (layout.dp * layout.cp))
    padded = -(-chunk // transfer.codec_block) * transfer.codec_block
    if transfer.op == "all_gather":
        encoded, decoded = padded, m * padded
    else:
        encoded = decoded = (m - 1) * padded
    passes = CODEC_ENCODE_PASSES * encoded + CODEC_DECODE_PASSES * decoded
    return passes * 2 * 4 / job.device.memory_bandwidth


def _latency(job: Job, layout: Layout, transfer: Transfer, busiest: GroupBytes) -> float:
    device = job.device
    if transfer.group == NODE:  # inside one node, over its dp ranks
        steps, _ = steps_and_volume(transfer.op, secondary_group_size(job, layout), 0.0)
        return steps * device.intra_node.for_op(op_family(transfer.op))[0]
    size = {GRADIENT: layout.dp * layout.cp, SHARD: layout.shard_degree * layout.cp}.get(
        transfer.group, layout.dp // layout.shard_degree
    )
    if busiest.hierarchical:
        seconds = 0.0
        for op, link in HIERARCHICAL_SUB_OPS[transfer.op]:
            across = link == "inter"
            repeat = 1
            if across and transfer.codec_bits:
                # payloads and scales in two ops; the reduce-scatter's as all-to-alls
                repeat, op = 2, ("all_to_all" if op == "reduce_scatter" else op)
            steps, _ = steps_and_volume(op, busiest.nodes if across else size // busiest.nodes, 0)
            alpha, _ = (device.inter_node if across else device.intra_node).for_op(op)
            seconds += repeat * steps * alpha
        return seconds
    steps, _ = steps_and_volume(transfer.op, size, 0.0)
    link = device.inter_node if busiest.nodes > 1 else device.intra_node
    return steps * link.for_op(op_family(transfer.op))[0]


def pipeline_cross_node(job: Job, layout: Layout) -> tuple[int, float]:
    """(bytes, seconds) of one step's pipeline transfers that cross a node: every micro-batch
    sends its activation forward over each chunk boundary (stage `s` to `s + 1`, the last
    stage back to the first between interleaved chunks) and its gradient back, from each rank
    to the rank at the same place of the next stage (link_bytes' `point_to_point`). Seconds:
    the busiest rank's cross-node sends at the inter-node link's send rate."""
    if layout.pp == 1:
        return 0, 0.0
    nodes, per_node = _nodes(job)
    stage_size = layout.dp * layout.cp * layout.tp
    sp_share = layout.tp if layout.sequence_parallel else 1
    activation = layout.micro_batch * job.seq_len // layout.cp * job.model.dim // sp_share
    nbytes = activation * job.precision.activation_bytes
    microbatches = max(job.global_batch // (layout.dp * layout.micro_batch), 1)
    total = busiest = 0
    for boundary in range(layout.pp * layout.virtual_stages - 1):
        sender, receiver = boundary % layout.pp, (boundary + 1) % layout.pp
        crossing, most = _crossing_pairs(nodes, per_node, stage_size, sender, receiver, nbytes)
        total += 2 * microbatches * crossing  # forward activation, backward gradient
        busiest += 2 * microbatches * most
    _, beta = job.device.inter_node.for_op("send")
    return total, busiest / beta


@functools.lru_cache(maxsize=4096)
def _crossing_pairs(
    nodes: int, per_node: int, stage_size: int, sender: int, receiver: int, nbytes: int
) -> tuple[int, int]:
    """(cross-node bytes summed over the sender stage's ranks, the most one rank sends) of a
    send of `nbytes` from every rank of stage `sender` to its place in stage `receiver`."""
    host_map = _host_map(nodes, per_node)
    total = most = 0
    for place in range(stage_size):
        rank, peer = sender * stage_size + place, receiver * stage_size + place
        across = point_to_point(rank, peer, nbytes, host_map).inter_node
        total += across
        most = max(most, across)
    return total, most


def price_transfers(
    job: Job, layout: Layout, stage_params: Sequence[float]
) -> tuple[PricedTransfer, ...]:
    return tuple(price_transfer(job, layout, t) for t in dp_transfers(job, layout, stage_params))


def dp_traffic(priced: Sequence[PricedTransfer]) -> Traffic:
    """One step's data-parallel bytes per link class, summed over the world, and the seconds
    the busiest rank spends sending its cross-node share."""
    return Traffic(
        intra_node=sum(p.transfer.times * p.total.intra_node for p in priced),
        inter_node=sum(p.transfer.times * p.total.inter_node for p in priced),
        inter_node_seconds=sum(p.transfer.times * p.inter_node_seconds for p in priced),
    )


__all__ = [
    "FLAT",
    "HIERARCHICAL",
    "NODE",
    "GroupBytes",
    "PricedTransfer",
    "Traffic",
    "Transfer",
    "dp_traffic",
    "dp_transfers",
    "hierarchical_applies",
    "job_host_map",
    "pipeline_cross_node",
    "price_transfer",
    "price_transfers",
    "secondary_group_size",
    "transfer_bytes",
]
