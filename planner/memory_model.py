"""Peak memory of one rank for a layout: model state by ZeRO stage, the dp ranks it is sharded
over (every dp rank, or HSDP's `dp_shard`) and precision, hpZ's secondary shards, activations
by tp / sp / cp / schedule / recomputation, the loss's logits, and buffers.

Activations are counted per token and layer as the tensors autograd keeps for backward
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
without dropout masks and with a fused attention kernel that keeps no score matrix):

    block input (norm 1)      h        replicated across tp unless sequence parallel
    q/k/v input (norm out)    h        replicated across tp unless sequence parallel
    q, k, v                   h + 2·kv sharded by tp
    attention output          h        sharded (input of the row-parallel projection)
    residual (norm 2 input)   h        replicated unless sequence parallel
    MLP input (norm out)      h        replicated unless sequence parallel
    MLP                       3·f (SwiGLU: gate, up, product) or 2·f (GELU: pre, post), sharded

Selective recomputation drops what element-wise ops produce (norm outputs, the SwiGLU product /
GELU output); full recomputation keeps only each block's input and rebuilds one block at a time
in backward. A rank holds as many micro-batches' activations as its schedule has forwards
without their backward (`schedule_model.max_in_flight`), each for its layers.

ZeRO's offload (`[zero.offload]`, `plait.plugins.zero.offload`) moves the fp32 master shards,
the fp32 copies of the gradient shards the optimizer reads and the optimizer state to the host,
where the optimizer steps; stage 3 also keeps its parameter shards there (an fp32 shard is its
own master) and uploads one for each gather. The device then holds no master weights, no
optimizer state and, under stage 3, no parameter shards (the gathered units are its buffers);
the host terms say what the host holds instead, at the step's peak. With "nvme" the optimizer
state lives in files between steps and is read back into host memory for each step, so the
host's peak is the same and the drive holds the state (`disk_optimizer_state`). On a device
that is its own host (`DeviceSpec.host_memory_bytes = None`, a CPU) nothing moves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from plait.planner.layouts import Job, Layout
from plait.planner.link_traffic import secondary_group_size
from plait.planner.schedule_model import max_in_flight

FP32_BYTES = 4  # offloaded masters and gradient copies are fp32 whatever the precision
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's and ZeRO's default bucket (`bucket_mb`)
ZERO2_BUCKETS_IN_FLIGHT = 2  # plait.plugins.zero.stage12.MAX_IN_FLIGHT


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    """Bytes on the rank with the most (the first or last pipeline stage)."""

    stage: int
    parameters: float
    gradients: float
    master_weights: float
    optimizer_state: float
    activations: float
    logits: float  # the loss's transient logits, softmax and their gradient (last stage)
    buffers: float  # gradient buckets, ZeRO-3 gather buffers, pipeline queues
    # hpZ: every unit's secondary shard, held from its forward to its backward
    secondary_shards: float = 0.0
    # `[zero.offload]`: where the terms below live ("none": nowhere, all zero)
    offload: str = "none"
    host_parameters: float = 0.0  # ZeRO-3's parameter shards
    host_master_weights: float = 0.0  # fp32 master shards (none apart from an fp32 shard)
    host_gradients: float = 0.0  # fp32 copies of the gradient shards, for the CPU optimizer
    host_optimizer_state: float = 0.0  # in host memory for the step (nvme: read back for it)
    disk_optimizer_state: float = 0.0  # nvme: the optimizer state in files between steps

    @property
    def model_state(self) -> float:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_state

    @property
    def host_total(self) -> float:
        """Host memory the offload takes on this rank at the optimizer step."""
        return (
            self.host_parameters + self.host_master_weights + self.host_gradients
            + self.host_optimizer_state
        )  # fmt: skip

    @property
    def total(self) -> float:
        return (
            self.model_state + self.activations + self.logits + self.buffers
            + self.secondary_shards
        )  # fmt: skip


@functools.lru_cache(maxsize=8192)
def layers_on_stage(n_layers: int, pp: int, stage: int) -> int:
    """Layers of pipeline stage `stage` when `n_layers` are split as evenly as possible, the
    spare layers going to the middle stages (the end stages also hold embedding and head)."""
    base, extra = divmod(n_layers, pp)
    if not extra:
        return base
    middle = list(range(1, pp - 1)) or list(range(pp))
    order = middle + [s for s in range(pp) if s not in middle]
    return base + (1 if stage in order[:extra] else 0)


def stage_parameters(job: Job, layout: Layout, stage: int) -> float:
    """Parameters one rank of `stage` holds (before ZeRO-3 sharding)."""
    model = job.model
    layers = layers_on_stage(model.n_layers, layout.pp, stage)
    experts = model.expert_params_per_layer
    dense = model.params_per_layer - experts
    per_layer = dense / layout.tp + experts / (layout.tp * layout.ep)
    total = layers * per_layer
    if stage == 0:
        total += model.embedding_params / layout.tp
    if stage == layout.pp - 1:
        total += model.head_params / layout.tp
    return total


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationCount:
    """Elements per token and layer on one tp rank, by how tensor parallelism splits them."""

    hidden: float  # width-h tensors around the norms: replicated across tp unless sp
    sharded: float  # q/k/v, attention output, MLP, scores: split by tp

    @property
    def total(self) -> float:
        return self.hidden + self.sharded

    def weighted(self, job: Job) -> float:
        """Elements the implementation keeps: each class scaled by its measured ratio."""
        return self.hidden * job.hidden_ratio + self.sharded * job.activation_ratio


def activation_elements_per_token(
    job: Job, layout: Layout
) -> tuple[ActivationCount, ActivationCount]:
    """(kept per layer per token, one layer's full set) on one tp rank."""
    model = job.model
    h, kv, t = model.dim, model.kv_dim, layout.tp
    ffn_width = model.top_k * model.expert_dim if model.num_experts else model.ffn_dim
    ffn_kept = model.ffn_matrices * ffn_width  # SwiGLU: gate, up, product; GELU: pre, post
    # Norm inputs and outputs (4 of width h) are replicated across tp without sp.
    split = float(t) if layout.sequence_parallel else 1.0
    norms = 4 * h / split
    sharded = (h + 2 * kv + h + ffn_kept) / t
    # Unfused attention keeps scores and softmax (2·a·T elements per token) and a dropout mask
    # (a·T bytes): Korthikanti et al.'s 5·a·s/h term.
    scores = 0.0 if job.fused_attention else 2.5 * model.n_heads * job.seq_len / t
    full = ActivationCount(hidden=norms, sharded=sharded + scores)
    if layout.recompute == "full":
        kept = ActivationCount(hidden=h / split, sharded=0.0)  # the block input only
    elif layout.recompute == "selective":  # norm outputs, scores and the MLP product rebuilt
        kept = ActivationCount(hidden=norms / 2, sharded=sharded - ffn_width / t)
    else:
        kept = full
    return kept, full


def estimate_memory(job: Job, layout: Layout) -> MemoryEstimate:
    """The larger of the first and the last stage's peak."""
    stages = {0, layout.pp - 1}
    return max((_stage_memory(job, layout, s) for s in stages), key=lambda m: m.total)


def _stage_memory(job: Job, layout: Layout, stage: int) -> MemoryEstimate:
    precision, model = job.precision, job.model
    params = stage_parameters(job, layout, stage)
    shard = layout.shard_degree  # HSDP shards over dp_shard and replicates across dp_replicate
    param_count = params / shard if layout.zero >= 3 else params
    grad_count = params / shard if layout.zero >= 2 else params
    optim_count = params / shard if layout.zero >= 1 else params
    tokens = layout.micro_batch * job.seq_len / layout.cp
    kept, full = activation_elements_per_token(job, layout)
    layers = layers_on_stage(model.n_layers, layout.pp, stage)
    in_flight_chunks = max_in_flight(
        layout.schedule,
        stages=layout.pp,
        microbatches=max(job.global_batch // (layout.dp * layout.micro_batch), 1),
        virtual=layout.virtual_stages,
        rank=stage,
    )
    chunk_layers = layers / layout.virtual_stages
    act = precision.activation_bytes
    activations = in_flight_chunks * chunk_layers * kept.weighted(job) * tokens * act
    if layout.recompute != "none":
        activations += full.weighted(job) * tokens * act  # the block being rebuilt in backward
    logits = 0.0
    if stage == layout.pp - 1:
        # logits (compute dtype), their fp32 log-softmax kept for backward, the fp32 gradient
        per_token = model.vocab_size / layout.tp
        upcast = 4 if act < 4 else 0
        logits = tokens * per_token * (act + upcast + 4 + 4)
    buffers = 0.0
    # DDP and ZeRO-1 reduce the gradients where they accumulate (the buckets are the
    # gradients' storage). ZeRO-2 fills a full bucket before reduce-scattering it, at most
    # ZERO2_BUCKETS_IN_FLIGHT at once; ZeRO-3 holds the gathered unit, the prefetched one and
    # the unit's full gradient bucket.
    if layout.zero == 2:
        full_grads = params * precision.grad_bytes
        buffers += min(ZERO2_BUCKETS_IN_FLIGHT * DDP_BUCKET_BYTES, full_grads)
    if layout.zero >= 3:
        largest_layer = model.params_per_layer / layout.tp
        buffers += 2 * largest_layer * precision.param_bytes
        buffers += largest_layer * precision.grad_bytes
    if layout.pp > 1:
        buffers += 2 * tokens * model.dim / (layout.tp if layout.sequence_parallel else 1) * act
    secondary = 0.0
    if layout.secondary_shard:
        # ZeRO++'s hpZ: after its forward each unit leaves this rank 1/k of it (k dp ranks per
        # node) until its backward gathers from them; at the end of the forward every unit's
        # share is held at once, P/k on top of the primary shards' P/dp.
        secondary = params / secondary_group_size(job, layout) * precision.param_bytes
    on_device = MemoryEstimate(
        stage=stage,
        parameters=param_count * precision.param_bytes,
        gradients=grad_count * precision.grad_bytes,
        master_weights=optim_count * precision.master_bytes,
        optimizer_state=optim_count * precision.optimizer_bytes,
        activations=activations,
        logits=logits,
        buffers=buffers,
        secondary_shards=secondary,
    )
    if not layout.offloaded:
        return on_device
    if job.device.host_memory_bytes is None:
        # A CPU is its own host: the state stays where it is (nvme still keeps it in files
        # between steps, and reads it back for the step).
        files = optim_count * precision.optimizer_bytes if layout.offload == "nvme" else 0.0
        return replace(on_device, offload=layout.offload, disk_optimizer_state=files)
    return offloaded(on_device, layout, job, shard_count=optim_count)


def offloaded(
    memory: MemoryEstimate, layout: Layout, job: Job, *, shard_count: float
) -> MemoryEstimate:
    """`memory` with `[zero.offload]`'s state moved to the host (and the drive), as
    `plait.plugins.zero` places it: `ShardedMaster` keeps fp32 masters, fp32 gradient copies
    and the optimizer state of this rank's `shard_count` elements on the CPU; stage 3's `Unit`
    keeps its parameter shard there."""
    precision = job.precision
    stage3 = layout.zero >= 3
    # Stage 3's fp32 shard on the host is the optimizer's parameter (no copy); any other
    # shard, on the device or in a 16-bit dtype, gets an fp32 master on the host.
    master_aliased = stage3 and precision.param_bytes == FP32_BYTES
    state = shard_count * precision.optimizer_bytes
    return replace(
        memory,
        parameters=0.0 if stage3 else memory.parameters,
        master_weights=0.0,
        optimizer_state=0.0,
        offload=layout.offload,
        host_parameters=memory.parameters if stage3 else 0.0,
        host_master_weights=0.0 if master_aliased else shard_count * FP32_BYTES,
        host_gradients=shard_count * FP32_BYTES,
        host_optimizer_state=state,
        disk_optimizer_state=state if layout.offload == "nvme" else 0.0,
    )


def fits(estimate: MemoryEstimate, usable_bytes: float) -> bool:
    return math.isfinite(estimate.total) and estimate.total <= usable_bytes


def fits_host(estimate: MemoryEstimate, usable_host_bytes: float | None) -> bool:
    """Whether the offloaded state fits the host's share (`None`: no host apart from the
    device, where offload moves nothing and so cannot make a layout fit)."""
    if not estimate.host_total:
        return True
    return usable_host_bytes is not None and estimate.host_total <= usable_host_bytes


def formula_saved_bytes(job: Job, layout: Layout) -> ActivationCount:
    """What the formula says one rank keeps for its blocks after a forward of one micro-batch
    of `layout` (no recomputation), in bytes by class, unscaled by the job's ratios: what a
    measurement of the blocks' saved tensors is divided by to calibrate them."""
    kept, _ = activation_elements_per_token(job, layout)
    scale = job.model.n_layers * layout.micro_batch * job.seq_len * job.precision.activation_bytes
    return ActivationCount(hidden=kept.hidden * scale, sharded=kept.sharded * scale)


def activation_ratios(
    measured: Sequence[tuple[Layout, float]], job: Job
) -> tuple[float, float] | None:
    """(hidden, sharded) ratios of measured to formula bytes, from the saved bytes of the
    blocks under two layouts whose tp degrees differ (tp splits the classes differently);
    `None` when the two do not separate them or give a ratio that is not positive."""
    (first, first_bytes), (second, second_bytes) = measured
    a, b = formula_saved_bytes(job, first), formula_saved_bytes(job, second)
    det = a.hidden * b.sharded - a.sharded * b.hidden
    if abs(det) < 1e-9 * abs(a.hidden * b.sharded):
        return None
    hidden = (first_bytes * b.sharded - second_bytes * a.sharded) / det
    sharded = (a.hidden * second_bytes - b.hidden * first_bytes) / det
    return (hidden, sharded) if hidden > 0 and sharded > 0 else None
