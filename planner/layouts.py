"""Parallel layouts, the job they are for, and the enumeration of the valid ones.

A `Layout` is one way to run a job: the degree of each mesh axis (dp × tp × pp × cp = world;
ep splits dp), the ZeRO stage of the dp axis and the dp ranks it shards over (`dp_shard`, HSDP:
replicated across the `dp / dp_shard` copies), the algorithm of the dp collectives (flat rings
or hierarchical: inside, across, inside), the micro-batch size, the pipeline schedule and its
virtual stages, activation recomputation and sequence parallelism. Rank order on the mesh is
Megatron's (tp fastest, then cp, dp_shard, dp_replicate, pp), so a group is inside one node when
its span fits.

`enumerate_layouts` yields every layout the rules allow for a `Job` and a `SearchSpace` (what
the training system supports): tp inside a node and dividing the heads, kv heads and FFN width;
cp splitting the sequence into 2·cp chunks (load-balanced causal ring); ep dividing dp and the
experts; a micro-batch size dividing each dp rank's share of the global batch; 1F1B needing as
many micro-batches as stages; interleaving needing a multiple of pp micro-batches and at least
one layer per chunk. On several nodes, a ZeRO stage may shard over `dp_shard` dp ranks whose
shard group (`dp_shard × cp × tp` consecutive ranks) stays inside a node, and the hierarchical
algorithm is a variant wherever a dp group it reduces over spans several nodes holding several
of its ranks each (`link_traffic.hierarchical_applies`). ZeRO++ on several nodes: ZeRO-3 over
every dp rank may keep hpZ's secondary shards (`secondary_shard`: backward gathers inside the
node) wherever the dp group spans nodes of several dp ranks each and nothing else (no cp, no ep);
with `SearchSpace.quantized_comm` only — the codecs change what is computed — hierarchical
ZeRO-3 without cp may quantize the parameter all-gather's cross-node hop (qwZ int8) and hierarchical
ZeRO-2/3 the gradient reduce-scatter's (qgZ int8 or int4). With `offload` ("cpu", "nvme"),
only ZeRO layouts are yielded, each with `[zero.offload]` on (a ZeRO stage over one dp rank
included: offload is what it is for), for the search's second pass when nothing fits without.
Memory is checked later (`search.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from plait.core.errors import ConfigError
from plait.planner.checkpoint_model import CheckpointPlan
from plait.planner.devices import DeviceSpec
from plait.planner.model_shape import ModelShape

RECOMPUTE_MODES = ("none", "selective", "full")
FLAT, HIERARCHICAL = "flat", "hierarchical"  # the dp collectives' algorithms
FIXABLE = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "dp_shard")
NO_CODEC = "none"
WEIGHT_CODECS = ("int8",)  # `zero.quantize_weights` (qwZ)
GRADIENT_CODECS = ("int8", "int4")  # `zero.quantize_gradients` (qgZ)
CODEC_BITS = {"int8": 8, "int4": 4}
CODEC_LEVELS = {"int8": 127, "int4": 7}  # L: a block's values round to s·[−L, L], s = absmax/L
PIPELINE_SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe", "zb_h1")
NO_OFFLOAD = "none"
OFFLOAD_DEVICES = ("cpu", "nvme")  # `zero.offload.device`: host memory, or files on a drive


@dataclass(frozen=True, slots=True, kw_only=True)
class Precision:
    """Bytes per element of each kind of state (mixed precision keeps fp32 masters)."""

    name: str
    param_bytes: int  # the weights the forward reads
    grad_bytes: int  # gradient accumulation buffers
    master_bytes: int  # fp32 master weights (0 when the params are fp32 already)
    optimizer_bytes: int  # AdamW exp_avg + exp_avg_sq
    activation_bytes: int
    dtype: str  # compute dtype, for the peak FLOP/s table


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(
        name="fp32", param_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bytes=8,
        activation_bytes=4, dtype="float32",
    ),
    # Megatron-LM / torchtitan mixed precision: bf16 weights, fp32 gradient accumulation and
    # fp32 master weights in the optimizer.
    "bf16": Precision(
        name="bf16", param_bytes=2, grad_bytes=4, master_bytes=4, optimizer_bytes=8,
        activation_bytes=2, dtype="bfloat16",
    ),
    # plait's amp transform: fp32 weights, gradients and AdamW state, bf16 compute.
    "amp-bf16": Precision(
        name="amp-bf16", param_bytes=4, grad_bytes=4, master_bytes=0, optimizer_bytes=8,
        activation_bytes=2, dtype="bfloat16",
    ),
}  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0  # 0 = DDP, 1/2/3 = ZeRO stage on the dp axis
    dp_shard: int = 0  # 0 = every dp rank (plain ZeRO); else HSDP's shard degree, dividing dp
    dp_algorithm: str = "flat"  # "flat" rings or "hierarchical" dp collectives
    micro_batch: int = 1
    schedule: str = "accumulate"  # "accumulate" without a pipeline
    virtual_stages: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    # ZeRO++ (`[zero]`): hpZ's secondary shards, and the codecs of the cross-node hops
    secondary_shard: bool = False
    quantize_weights: str = NO_CODEC
    quantize_gradients: str = NO_CODEC
    quantize_block: int = 256  # elements per codec block (one fp32 scale each)
    # `[zero.offload]`: ZeRO's optimizer state (and stage 3's parameter shards) on the host
    offload: str = NO_OFFLOAD

    @property
    def offloaded(self) -> bool:
        """Whether ZeRO keeps its optimizer state off the device (`[zero.offload]`)."""
        return self.zero >= 1 and self.offload != NO_OFFLOAD

    @property
    def quantized(self) -> bool:
        """Whether a codec quantizes a cross-node hop (what is computed changes)."""
        return self.quantize_weights != NO_CODEC or self.quantize_gradients != NO_CODEC

    @property
    def weight_codec_bits(self) -> int:
        """Bits per element of qwZ's encoded hop (0: unencoded)."""
        return CODEC_BITS.get(self.quantize_weights, 0)

    @property
    def gradient_codec_bits(self) -> int:
        """Bits per element of qgZ's encoded hop (0: unencoded)."""
        return CODEC_BITS.get(self.quantize_gradients, 0)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def degrees(self) -> tuple[int, int, int, int, int]:
        """(tp, cp, pp, dp, ep): the mesh alone, what a published layout names."""
        return (self.tp, self.cp, self.pp, self.dp, self.ep)

    @property
    def shard_degree(self) -> int:
        """The dp ranks ZeRO shards its state over: `dp_shard`, or every dp rank."""
        return self.dp_shard or self.dp

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        if self.cp > 1:
            parts.insert(2, f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"zero{self.zero}" if self.zero else "ddp")
        if self.offloaded:
            parts.append(f"offload-{self.offload}")
        if self.dp_shard:
            parts.append(f"shard{self.dp_shard}")
        if self.dp_algorithm != FLAT:
            parts.append(self.dp_algorithm)
        if self.secondary_shard:
            parts.append("hpZ")
        if self.quantize_weights != NO_CODEC:
            parts.append(f"qwZ-{self.quantize_weights}")
        if self.quantize_gradients != NO_CODEC:
            parts.append(f"qgZ-{self.quantize_gradients}")
        parts.append(f"mb{self.micro_batch}")
        if self.pp > 1:
            schedule = self.schedule
            if self.virtual_stages > 1:
                schedule += f"×{self.virtual_stages}"
            parts.append(schedule)
        if self.recompute != "none":
            parts.append(f"ac-{self.recompute}")
        if self.sequence_parallel:
            parts.append("sp")
        return " ".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """What to train and on what: the model, the batch and the cluster."""

    model: ModelShape
    seq_len: int
    global_batch: int  # sequences per optimizer step
    world: int
    per_node: int
    device: DeviceSpec
    precision: Precision = PRECISIONS["bf16"]
    # A fused attention kernel (FlashAttention, SDPA) keeps no score matrix; without one the
    # scores, their softmax and its dropout mask are kept and streamed through memory.
    fused_attention: bool = True
    # What the model's implementation keeps for backward over what the per-token count in
    # `memory_model` says (1: the formula), for the tensors tp shards and, where measured apart,
    # for the width-h tensors around the norms that it replicates (`None`: the same ratio).
    # Measured once per model family and host by e.g. `tools/bench/plan.py` (saved bytes after
    # one forward with and without tp, `memory_model.activation_ratios`).
    activation_ratio: float = 1.0
    hidden_activation_ratio: float | None = None
    # How often it saves checkpoints (`checkpoint_model`); None: it saves none.
    checkpoint: CheckpointPlan | None = None

    @property
    def hidden_ratio(self) -> float:
        if self.hidden_activation_ratio is None:
            return self.activation_ratio
        return self.hidden_activation_ratio

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch", "world", "per_node"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world % self.per_node and self.world > self.per_node:
            raise ConfigError(
                f"--world {self.world} is not a multiple of --per-node {self.per_node}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSpace:
    """What the training system offers; the defaults are what plait implements."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b")
    virtual_stages: tuple[int, ...] = (2, 4, 8)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    sequence_parallel: tuple[bool, ...] = (True,)
    # Topology-aware data parallelism on several nodes: ZeRO sharded over the dp ranks of part
    # of a node (HSDP), and hierarchical dp collectives.
    hybrid_sharding: bool = True
    hierarchical: bool = True
    # ZeRO++ on several nodes: hpZ's secondary shards (memory for cross-node bytes, the same
    # values computed), and the int8/int4 codecs of the cross-node hops, which perturb weights
    # and gradients within their bounds: offered only when the user allows quantized
    # communication (`plait plan --allow-quantized-comm`).
    secondary_shard: bool = True
    quantized_comm: bool = False
    quantize_block: int = 256
    # `[zero.offload]` devices tried when no layout fits without (`search.plan`'s second
    # pass): offload trades step time for device memory, so it is never preferred. "nvme" needs
    # a directory the planner does not know: tried when a config names one (`auto.py`).
    offload: tuple[str, ...] = ("cpu",)
    max_tp: int = 0  # 0 = devices per node
    max_pp: int = 0  # 0 = layers
    max_cp: int = 16
    fixed: dict[str, int] = field(default_factory=dict)  # e.g. {"tp": 2}: only these degrees

    def __post_init__(self) -> None:
        for mode in self.recompute:
            if mode not in RECOMPUTE_MODES:
                raise ConfigError(f"recompute: {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
        for name in self.schedules:
            if name not in PIPELINE_SCHEDULES:
                raise ConfigError(
                    f"schedules: {name!r} is not one of {', '.join(PIPELINE_SCHEDULES)}"
                )
        for stage in self.zero_stages:
            if stage not in (0, 1, 2, 3):
                raise ConfigError(f"zero_stages: {stage} is not one of 0, 1, 2, 3")
        if self.quantize_block < 2 or self.quantize_block % 2:
            raise ConfigError(
                f"quantize_block must be an even number of elements >= 2, got {self.quantize_block}"
            )
        for device in self.offload:
            if device not in OFFLOAD_DEVICES:
                raise ConfigError(f"offload: {device!r} is not one of {', '.join(OFFLOAD_DEVICES)}")
        for axis in self.fixed:
            if axis not in FIXABLE:
                raise ConfigError(f"fixed: {axis!r} is not one of {', '.join(FIXABLE)}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, value = [], 1
    while value <= limit:
        out.append(value)
        value *= 2
    return out


def _tp_fits(model: ModelShape, tp: int) -> bool:
    width = model.expert_dim if model.num_experts else model.ffn_dim
    return (
        model.n_heads % tp == 0
        and (model.kv_heads % tp == 0 or tp % model.kv_heads == 0)
        and (width % tp == 0)
    )


def enumerate_layouts(
    job: Job, space: SearchSpace | None = None, *, offload: str = NO_OFFLOAD
) -> Iterator[Layout]:
    """Every layout the divisibility and placement rules allow (memory not yet checked); with
    `offload`, every ZeRO layout with its optimizer state offloaded there."""
    space = space or SearchSpace()
    model, fixed = job.model, space.fixed
    max_tp = min(space.max_tp or job.per_node, job.per_node)
    max_pp = min(space.max_pp or model.n_layers, model.n_layers)

    def allowed(axis: str, value: int) -> bool:
        return axis not in fixed or fixed[axis] == value

    for tp in _powers_of_two(max_tp):
        if job.world % tp or not _tp_fits(model, tp) or not allowed("tp", tp):
            continue
        for cp in _powers_of_two(space.max_cp):
            if job.world % (tp * cp) or job.seq_len % (2 * cp) or not allowed("cp", cp):
                continue
            if cp > 1 and cp * tp > job.per_node and tp < job.per_node:
                continue  # cp rings cross nodes only once tp fills the node
            for pp in _divisors(job.world // (tp * cp)):
                if pp > max_pp or not allowed("pp", pp):
                    continue
                dp = job.world // (tp * cp * pp)
                if job.global_batch % dp or not allowed("dp", dp):
                    continue
                per_dp = job.global_batch // dp
                yield from _variants(
                    job, space, tp=tp, cp=cp, pp=pp, dp=dp, per_dp=per_dp, offload=offload
                )


def _variants(
    job: Job,
    space: SearchSpace,
    *,
    tp: int,
    cp: int,
    pp: int,
    dp: int,
    per_dp: int,
    offload: str = NO_OFFLOAD,
) -> Iterator[Layout]:
    model, fixed = job.model, space.fixed
    eps = [1]
    if model.num_experts:
        eps = [e for e in _divisors(dp) if model.num_experts % e == 0]
    for ep in eps:
        if "ep" in fixed and fixed["ep"] != ep:
            continue
        for micro_batch in space.micro_batches:
            if per_dp % micro_batch or (
                "micro_batch" in fixed and fixed["micro_batch"] != micro_batch
            ):
                continue
            microbatches = per_dp // micro_batch
            for schedule, virtual in _schedules(
                space, pp=pp, microbatches=microbatches, layers=model.n_layers
            ):
                for zero in space.zero_stages:
                    if "zero" in fixed and fixed["zero"] != zero:
                        continue
                    # Offload is ZeRO's; and ZeRO over one dp rank shards nothing, but with
                    # offload it still moves the optimizer state off the device.
                    if offload != NO_OFFLOAD and not zero:
                        continue
                    if dp == 1 and zero and offload == NO_OFFLOAD:
                        continue
                    if zero == 3 and pp > 1:
                        continue  # ZeRO-3 re-gathers per micro-batch: never paired with pp
                    for dp_shard, algorithm in _data_parallel(job, space, tp, cp, pp, dp, zero):
                        mesh = Layout(
                            dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, dp_shard=dp_shard,
                            dp_algorithm=algorithm,
                        )  # fmt: skip
                        for hpz, weights, grads in _zero_plus_plus(job, space, mesh):
                            for recompute in space.recompute:
                                for sp in space.sequence_parallel if tp > 1 else (False,):
                                    yield Layout(
                                        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero,
                                        dp_shard=dp_shard, dp_algorithm=algorithm,
                                        micro_batch=micro_batch, schedule=schedule,
                                        virtual_stages=virtual, recompute=recompute,
                                        sequence_parallel=sp, secondary_shard=hpz,
                                        quantize_weights=weights, quantize_gradients=grads,
                                        quantize_block=space.quantize_block,
                                        offload=offload,
                                    )  # fmt: skip


def _data_parallel(
    job: Job, space: SearchSpace, tp: int, cp: int, pp: int, dp: int, zero: int
) -> Iterator[tuple[int, str]]:
    """(dp_shard, dp algorithm) choices: every dp rank with flat rings, the hierarchical
    algorithm where it changes the dp traffic, and (ZeRO) each shard degree whose shard group
    stays inside a node of a multi-node job."""
    from plait.planner.link_traffic import hierarchical_applies

    shards = [0]
    if zero and space.hybrid_sharding and job.world > job.per_node:
        shards += [d for d in _divisors(dp)[1:-1] if job.per_node % (d * cp * tp) == 0]
    for dp_shard in shards:
        if "dp_shard" in space.fixed and space.fixed["dp_shard"] != dp_shard:
            continue
        yield dp_shard, FLAT
        # The runtime's hierarchical algorithm takes over the dp axis's groups only
        # (`plait.core.comm_algorithms.config_rank_sets`): not HSDP's replica groups, nor the
        # dp × cp group that gradients reduce over with cp > 1. Those run flat rings, so a
        # hierarchical row there would promise traffic the run does not have.
        whole_dp_group = dp_shard in (0, dp) and cp == 1
        flat = Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, dp_shard=dp_shard)
        if (
            space.hierarchical
            and whole_dp_group
            and hierarchical_applies(flat, world=job.world, per_node=job.per_node)
        ):
            yield dp_shard, HIERARCHICAL


def _zero_plus_plus(job: Job, space: SearchSpace, mesh: Layout) -> Iterator[tuple[bool, str, str]]:
    """(hpZ, qwZ codec, qgZ codec) choices for a mesh, as the runtime accepts them
    (`plait.plugins.zero`): hpZ with ZeRO-3 over every dp rank (no HSDP, cp or ep) whose dp
    group spans several nodes of several ranks each; a codec only on a hierarchical dp group (no
    cp) of ZeRO-3 (weights) or ZeRO-2/3 (gradients) over every dp rank, and only when the space
    allows quantized communication."""
    from plait.planner.link_traffic import hierarchical_applies

    whole_dp = mesh.zero >= 2 and not mesh.dp_shard and mesh.ep == 1
    spans = whole_dp and hierarchical_applies(
        replace(mesh, dp_algorithm=HIERARCHICAL), world=job.world, per_node=job.per_node
    )
    secondary = [False]
    if space.secondary_shard and spans and mesh.zero == 3 and mesh.cp == 1:
        secondary.append(True)
    weights, grads = [NO_CODEC], [NO_CODEC]
    # the hierarchical algorithm takes over the dp groups only, not dp × cp: no codec with cp
    if space.quantized_comm and spans and mesh.dp_algorithm == HIERARCHICAL and mesh.cp == 1:
        grads += GRADIENT_CODECS
        if mesh.zero == 3:
            weights += WEIGHT_CODECS
    for hpz in secondary:
        for weight in weights:
            for grad in grads:
                yield hpz, weight, grad


def _schedules(
    space: SearchSpace, *, pp: int, microbatches: int, layers: int
) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "accumulate", 1
        return
    for name in space.schedules:
        if name == "interleaved_1f1b":
            if microbatches < pp or microbatches % pp:
                continue
            for virtual in space.virtual_stages:
                if layers >= pp * virtual:
                    yield name, virtual
        elif name in ("1f1b", "zb_h1"):
            if microbatches >= pp:
                yield name, 1
        else:
            yield name, 1
