"""Predicted step time of a layout, term by term.

Compute: each block's matmul FLOPs at the GEMM efficiency of its size
(`DeviceSpec.gemm_seconds`), attention FLOPs at the attention kernels' efficiency, element-wise
work (norms, residuals, rotary, activation) at memory bandwidth, plus a fixed cost per block and
pass for launching its ops (`DeviceSpec.block_overhead`: what makes many small micro-batches
slower than a few large ones); backward costs twice the
forward's matmuls, 2.5 times its attention. Recomputation adds a forward (full) or the
element-wise part (selective) to every backward; either replays the block's forward op by op,
so both pay the block's launch cost again (selective only skips the kept matmuls' work).

Host overhead (`host_overhead`): the fixed costs a strategy adds on the host whatever the sizes
(`DeviceSpec.tp_block_overhead` per block pass and tp peer, `zero3_unit_overhead` per ZeRO-3 unit
and micro-batch, `microbatch_overhead` per micro-batch); 0 on GPUs, where the host runs ahead of
the device, measured on CPU hosts. It is part of each stage's work in the pipeline schedule.
Selective recomputation's own (`selective_block_overhead`, per block and micro-batch) is
counted in `recompute`.

Communication (α–β, `comm_model`), with the overlap each strategy has in plait:

* tp: two all-reduces per block per pass (sequence parallel: two all-gathers and two
  reduce-scatters), on the critical path (exposed);
* cp: the ring passes K/V (and dK/dV backward) while attention computes; only the excess shows;
* ep: all-to-all dispatch and combine per MoE block and pass, exposed;
* pp: one activation transfer per stage boundary, inside the schedule simulation
  (`schedule_model.pipeline_makespan`), which also gives the bubble;
* dp (DDP, ZeRO-1/2): the gradient reduction overlaps the last micro-batch's backward when
  there is no pipeline, and nothing with one (the pipeline syncs after its last backward);
  ZeRO-1/2 then all-gather the updated parameters; ZeRO-3 gathers every unit for forward and
  backward of every micro-batch, prefetched under the compute, and reduce-scatters gradients;
  HSDP then all-reduces each gradient shard across the replicas, exposed; hpZ gathers
  backward's units inside the node, and ZeRO++'s codecs shrink the cross-node hop's bytes at
  the price of encoding and decoding at memory bandwidth. Each of these is
  priced per link class from the bytes `plait.core.link_bytes` counts on every rank of the
  mesh's groups (`link_traffic`): the busiest rank's intra-node bytes at the intra-node β, its
  cross-node bytes at the inter-node β, flat rings or hierarchical as the layout says.

The optimizer step is memory bound: every byte of parameters, gradients and AdamW state it
reads and writes, at memory bandwidth.

Checkpoint saves (`checkpoint_model`): what a save makes its step wait — the copy off the device,
and the write when synchronous or when it outlasts the save interval — divided by the interval.

ZeRO's offload (`[zero.offload]`) moves the step to the host: it reads and writes fp32 masters,
fp32 gradient copies and AdamW state at the host's memory bandwidth (`optimizer`), and
`offload` prices the host link (`DeviceSpec.host_link`, α–β like the other links): stages 1
and 2 copy the gradient shard down before the step and the updated parameter shard up after
it, on the critical path; stage 3 copies the gradient shard down and uploads each unit's shard
for each gather (forward, and backward unless hpZ), prefetched with the gathers under the
micro-batch's compute, so only the excess shows. With "nvme" the state is also written to and
read back from files (`DeviceSpec.disk_bandwidth`) while forward and backward run; only what
they do not cover shows. On a device with no separate host (a CPU) offload moves nothing and
costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from plait.planner.checkpoint_model import checkpoint_cost
from plait.planner.comm_model import collective_seconds, link_for
from plait.planner.layouts import Job, Layout
from plait.planner.link_traffic import (
    PricedTransfer,
    dp_traffic,
    pipeline_cross_node,
    price_transfers,
)
from plait.planner.memory_model import (
    DDP_BUCKET_BYTES,
    FP32_BYTES,
    estimate_memory,
    layers_on_stage,
    stage_parameters,
)
from plait.planner.schedule_model import pipeline_makespan

# Element-wise traffic per token and block, in elements read + written: two norms (2 h in,
# 2 h out), two residual adds (3 h each), rotary on q and k (2 h); per FFN width: the SwiGLU /
# GELU product (3 f). Backward moves about twice as much.
ELEMENTWISE_PER_DIM = 14.0
ELEMENTWISE_PER_FFN = 3.0
ATTENTION_BACKWARD_FACTOR = 2.5


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTimeEstimate:
    """Seconds per optimizer step on the slowest stage, by term (they add up to `total`)."""

    compute: float  # forward + backward of all micro-batches, no recomputation
    recompute: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    pipeline_bubble: float  # idle time in the schedule, including activation transfers
    dp_comm: float  # exposed gradient / parameter collectives
    optimizer: float
    host_overhead: float  # fixed host costs: tp dispatch, ZeRO-3 hooks, per micro-batch
    offload: float = 0.0  # exposed host-link (and drive) transfers of `[zero.offload]`
    checkpoint: float = 0.0  # what checkpoint saves make a step wait, amortised per step
    model_flops: float  # per step, whole job (6·N + attention per token)
    hardware_flops: float  # per step, whole job, recomputation included
    world: int
    peak_flops: float  # per device
    # The bytes of the dp and pipeline traffic that cross a node boundary in one step, summed
    # over the ranks, and the seconds the busiest rank spends sending its share (overlapped or
    # not).
    cross_node_bytes: int = 0
    cross_node_seconds: float = 0.0

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.recompute
            + self.tp_comm
            + self.cp_comm
            + self.ep_comm
            + self.pipeline_bubble
            + self.dp_comm
            + self.optimizer
            + self.host_overhead
            + self.offload
            + self.checkpoint
        )

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.total * self.world * self.peak_flops)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.total * self.world * self.peak_flops)

    def terms(self) -> dict[str, float]:
        skip = {
            "model_flops", "hardware_flops", "world", "peak_flops", "cross_node_bytes",
            "cross_node_seconds",
        }  # fmt: skip
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


@dataclass(frozen=True, slots=True, kw_only=True)
class _PassTimes:
    """One block (or the head), one micro-batch, on one rank."""

    forward: float
    backward: float
    recompute: float
    comm_forward: float
    comm_backward: float
    comm_recompute: float
    cp_exposed: float  # forward + backward (+ recompute)
    ep_comm: float
    host_forward: float  # tp's fixed host cost per pass (backward: twice, recompute: once more)
    host_recompute: float


def _block_times(job: Job, layout: Layout) -> _PassTimes:
    model, device, act = job.model, job.device, job.precision.activation_bytes
    tp, cp, sp = layout.tp, layout.cp, layout.sequence_parallel
    tokens = layout.micro_batch * job.seq_len / cp
    matmul = 2.0 * tokens * model.active_params_per_layer / tp
    ffn_width = model.expert_dim if model.num_experts else model.ffn_dim
    gemm_size = 2.0 * tokens * model.dim * ffn_width / tp
    if model.num_experts:  # an expert sees its share of the routed tokens
        gemm_size *= model.top_k / max(model.num_experts / layout.ep, 1.0)
    attention = 2.0 * tokens * model.dim * job.seq_len / tp  # causal: half the square, ×2 FLOPs
    dim_share = tokens * model.dim / (tp if sp else 1)
    ffn_share = tokens * ffn_width * max(model.top_k, 1) / tp
    elementwise = (ELEMENTWISE_PER_DIM * dim_share + ELEMENTWISE_PER_FFN * ffn_share) * act
    if not job.fused_attention:  # scores written, softmaxed, masked and read: ~4 passes
        elementwise += 4.0 * tokens * model.n_heads * job.seq_len / tp * act
    t_matmul = device.gemm_seconds(matmul, gemm_size)
    t_attention = attention / (device.peak_flops * device.attention_efficiency)
    t_elementwise = elementwise / device.memory_bandwidth
    overhead = device.block_overhead  # launching the block's ops, whatever their size
    forward = t_matmul + t_attention + t_elementwise + overhead
    backward = (
        2 * t_matmul + ATTENTION_BACKWARD_FACTOR * t_attention + 2 * t_elementwise + 2 * overhead
    )
    # Selective recomputation replays the block's forward too (its kept matmul outputs are
    # served from the cache), so it pays the block's launch cost again.
    selective = t_elementwise + overhead + device.selective_block_overhead
    recompute = {"full": forward, "selective": selective}.get(layout.recompute, 0.0)
    # per peer: a ring collective has a step per peer, each one a wait on a rank's schedule
    tp_host = device.tp_block_overhead * (tp - 1)

    comm = 0.0
    if tp > 1:
        link = link_for(device, size=tp, stride=1, per_node=job.per_node)
        activation = tokens * model.dim * act
        if sp:
            comm = 2 * collective_seconds("all_gather", tp, activation, link)
            comm += 2 * collective_seconds("reduce_scatter", tp, activation, link)
        else:
            comm = 2 * collective_seconds("all_reduce", tp, activation, link)
    cp_exposed = 0.0
    if cp > 1:
        link = link_for(device, size=cp, stride=tp, per_node=job.per_node)
        kv = tokens * 2 * model.kv_dim / tp * act
        ring = (cp - 1) * collective_seconds("send", 2, kv, link)
        cp_exposed = max(ring - t_attention, 0.0) + max(
            2 * ring - ATTENTION_BACKWARD_FACTOR * t_attention, 0.0
        )
        if layout.recompute == "full":
            cp_exposed += max(ring - t_attention, 0.0)
    ep_comm = 0.0
    if model.num_experts and layout.ep > 1:
        link = link_for(device, size=layout.ep, stride=tp * cp, per_node=job.per_node)
        routed = tokens * model.top_k * model.dim / tp * act
        ep_comm = 4 * collective_seconds("all_to_all", layout.ep, routed, link)
    return _PassTimes(
        forward=forward,
        backward=backward,
        recompute=recompute,
        comm_forward=comm,
        comm_backward=comm,
        comm_recompute=comm if layout.recompute == "full" else 0.0,
        cp_exposed=cp_exposed,
        ep_comm=ep_comm,
        host_forward=tp_host,
        host_recompute=tp_host if layout.recompute in ("full", "selective") else 0.0,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _StageCost:
    """One stage, one micro-batch: compute and exposed communication."""

    forward: float
    backward: float
    recompute: float
    tp_forward: float
    tp_backward: float
    cp: float
    ep: float
    host_forward: float
    host_backward: float

    @property
    def total(self) -> float:
        return (
            self.forward + self.backward + self.recompute + self.tp_forward + self.tp_backward
            + self.cp + self.ep + self.host_forward + self.host_backward
        )  # fmt: skip


def _head_times(job: Job, layout: Layout) -> tuple[float, float]:
    """(forward, backward) of the output projection and the loss, one micro-batch."""
    model, device = job.model, job.device
    tokens = layout.micro_batch * job.seq_len / layout.cp
    matmul = 2.0 * tokens * model.head_params / layout.tp
    t_matmul = device.gemm_seconds(matmul, matmul)
    loss_bytes = tokens * model.vocab_size / layout.tp * 4 * 4  # softmax read/write, fp32
    t_loss = loss_bytes / device.memory_bandwidth
    overhead = device.block_overhead
    return t_matmul + t_loss + overhead, 2 * (t_matmul + overhead) + t_loss


def estimate_step_time(job: Job, layout: Layout) -> StepTimeEstimate:
    model, device, precision = job.model, job.device, job.precision
    microbatches = job.global_batch // (layout.dp * layout.micro_batch)
    block = _block_times(job, layout)
    head_forward, head_backward = _head_times(job, layout)
    last = layout.pp - 1

    zero3_units = layout.zero == 3 and layout.dp * layout.cp > 1

    def stage_cost(stage: int) -> _StageCost:
        layers = layers_on_stage(model.n_layers, layout.pp, stage)
        head = stage == last
        # Fixed host costs per micro-batch: tp's per block and head pass, ZeRO-3's per unit
        # (gathered for forward and for backward), the engine's per micro-batch; half of the
        # non-tp part is counted on each side of the pass.
        passes = layers + (1 if head else 0)
        fixed = device.microbatch_overhead
        if zero3_units:
            fixed += layers * device.zero3_unit_overhead
        return _StageCost(
            forward=layers * block.forward + (head_forward if head else 0.0),
            backward=layers * block.backward + (head_backward if head else 0.0),
            recompute=layers * block.recompute,
            tp_forward=layers * block.comm_forward,
            tp_backward=layers * (block.comm_backward + block.comm_recompute),
            cp=layers * block.cp_exposed,
            ep=layers * block.ep_comm,
            host_forward=passes * block.host_forward + fixed / 2,
            host_backward=passes * (2 * block.host_forward + block.host_recompute) + fixed / 2,
        )

    # The busiest stage sets the pace of the pipeline (an uneven split makes a middle one so).
    stages = {0, last, min(1, last), max(last - 1, 0)}
    cost = max((stage_cost(s) for s in stages), key=lambda c: c.total)
    v = layout.virtual_stages
    p2p = 0.0
    if layout.pp > 1:
        link = link_for(
            device, size=layout.pp, stride=layout.tp * layout.cp * layout.dp, per_node=job.per_node
        )
        sp_share = layout.tp if layout.sequence_parallel else 1
        activation = layout.micro_batch * job.seq_len / layout.cp * model.dim / sp_share
        p2p = collective_seconds("send", 2, activation * precision.activation_bytes, link)
    # A forward chunk carries its share of the forward-side comm, a backward chunk the rest.
    f_chunk = (cost.forward + cost.tp_forward + cost.cp / 3 + cost.ep / 2 + cost.host_forward) / v
    b_chunk = cost.total / v - f_chunk
    makespan = pipeline_makespan(
        layout.schedule,
        stages=layout.pp,
        microbatches=microbatches,
        virtual=v,
        forward=f_chunk,
        backward=b_chunk,
        p2p=p2p,
    )
    busy = microbatches * cost.total
    if device.oversubscription > 1:
        # Ranks sharing cores: the schedule's critical path runs at the rate of a rank with
        # the cores to itself (faster by the oversubscription), the work at the shared rate.
        makespan = max(makespan / device.oversubscription, busy)
    bubble = max(makespan - busy, 0.0)

    params = max(stage_parameters(job, layout, s) for s in {0, last})
    priced = price_transfers(
        job, layout, [stage_parameters(job, layout, s) for s in range(layout.pp)]
    )
    dp_comm = _dp_seconds(
        job, layout, priced, microbatches, cost.backward + cost.recompute, cost.forward
    )
    traffic = dp_traffic(priced)
    pipeline_bytes, pipeline_seconds = pipeline_cross_node(job, layout)
    optim_params = params / layout.shard_degree if layout.zero >= 1 else params
    offload = 0.0
    if layout.offloaded and device.host_memory_bytes is not None:
        # On the host: fp32 masters, fp32 gradient copies and the state, read and written.
        host_bytes = optim_params * 2 * (2 * FP32_BYTES + precision.optimizer_bytes)
        optimizer = host_bytes / device.host_memory_bandwidth
        offload = _offload_seconds(job, layout, optim_params, microbatches, cost)
    else:
        optimizer_bytes = optim_params * (
            2 * precision.param_bytes
            + 2 * precision.grad_bytes
            + 2 * precision.optimizer_bytes
            + 2 * precision.master_bytes
        )
        optimizer = optimizer_bytes / device.memory_bandwidth

    tokens_per_step = job.global_batch * job.seq_len
    model_flops = model.model_flops_per_token(job.seq_len) * tokens_per_step
    recompute_flops = 0.0
    if layout.recompute == "full":
        # one more forward of every block: its matmuls (2 per weight) and its attention
        attention = model.model_flops_per_token(job.seq_len) - 6.0 * model.dense_active_params
        per_token = 2.0 * model.n_layers * model.active_params_per_layer + attention / 3
        recompute_flops = per_token * tokens_per_step
    estimate = StepTimeEstimate(
        compute=microbatches * (cost.forward + cost.backward),
        recompute=microbatches * cost.recompute,
        tp_comm=microbatches * (cost.tp_forward + cost.tp_backward),
        cp_comm=microbatches * cost.cp,
        ep_comm=microbatches * cost.ep,
        pipeline_bubble=bubble,
        dp_comm=dp_comm,
        optimizer=optimizer,
        host_overhead=microbatches * (cost.host_forward + cost.host_backward),
        offload=offload,
        model_flops=model_flops,
        hardware_flops=model_flops + recompute_flops,
        world=layout.world,
        peak_flops=device.peak_flops,
        cross_node_bytes=traffic.inter_node + pipeline_bytes,
        cross_node_seconds=traffic.inter_node_seconds + pipeline_seconds,
    )
    if job.checkpoint is None:
        return estimate
    saves = checkpoint_cost(job, layout, estimate_memory(job, layout), estimate.total)
    return estimate if saves is None else replace(estimate, checkpoint=saves.per_step_seconds)


def _offload_seconds(
    job: Job, layout: Layout, shard: float, microbatches: int, cost: _StageCost
) -> float:
    """Exposed seconds per step of `[zero.offload]`'s transfers for this rank's `shard`
    elements (see the module docstring)."""
    precision, link = job.precision, job.device.host_link
    grads_down = collective_seconds("send", 2, shard * precision.grad_bytes, link)
    if layout.zero < 3:
        params_up = collective_seconds("send", 2, shard * precision.param_bytes, link)
        seconds = grads_down + params_up
    else:
        units = max(job.model.n_layers, 1)
        gathers = 1 if layout.secondary_shard else 2  # hpZ's backward gathers from the node
        upload = units * collective_seconds("send", 2, shard * precision.param_bytes / units, link)
        seconds = grads_down + microbatches * max(
            gathers * upload - (cost.forward + cost.backward), 0.0
        )
    if layout.offload == "nvme":
        written_and_read = 2 * shard * precision.optimizer_bytes / job.device.disk_bandwidth
        seconds += max(written_and_read - microbatches * (cost.forward + cost.backward), 0.0)
    return seconds


def _dp_seconds(
    job: Job,
    layout: Layout,
    priced: tuple[PricedTransfer, ...],
    microbatches: int,
    last_backward: float,
    forward: float,
) -> float:
    """Exposed data-parallel communication per step."""
    if not priced:
        return 0.0
    by_purpose = {p.transfer.purpose: p for p in priced}
    gradients = by_purpose["gradients"]
    reduce = gradients.seconds()
    # The last gradient bucket cannot overlap anything: it is reduced after backward ends.
    grad_bytes = max(gradients.transfer.numel) * gradients.transfer.itemsize
    last_bucket = gradients.seconds(min(DDP_BUCKET_BYTES / grad_bytes, 1.0) if grad_bytes else 1)
    replicas = by_purpose["replicas"].seconds() if "replicas" in by_purpose else 0.0
    overlap = last_backward if layout.pp == 1 else 0.0
    if layout.zero == 0:
        return max(reduce - overlap, 0.0) + min(reduce, last_bucket)
    gather = by_purpose["parameters"].seconds()
    if layout.zero in (1, 2):
        return max(reduce - overlap, 0.0) + min(reduce, last_bucket) + gather + replicas
    # ZeRO-3: per micro-batch, gather for forward and for backward (with hpZ from the secondary
    # shards, inside the node), reduce-scatter gradients; prefetching hides it under that
    # micro-batch's compute.
    backward_gather = by_purpose["secondary"].seconds() if "secondary" in by_purpose else gather
    per_microbatch = gather + backward_gather + reduce
    exposed = max(per_microbatch - (forward + last_backward), 0.0)
    first_unit = gather / max(job.model.n_layers, 1)
    return microbatches * (exposed + first_unit) + replicas
