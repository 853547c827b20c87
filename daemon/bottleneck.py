"""Bottleneck breakdown: where each step's wall time went, per rank, and what to do about it.

Every nanosecond of a step (the step span, data wait included) is given to exactly one class,
in this order of precedence, so the classes add up to the step time:

1. **compute** — forward/backward phase spans, minus the intervals of *blocking* (synchronous)
   collectives issued inside them: a synchronous tensor-parallel all-reduce stalls the compute
   stream even though it sits inside a forward span.
2. **pipeline_bubble** — "idle" phase spans and the pipeline runtime's "send"/"recv" phases
   (waiting for the neighbouring stage), minus compute.
3. **exposed_comm** — the union of all collective intervals minus compute and bubble. This is
   Holistic Trace Analysis's definition: communication time not overlapped by compute. An
   asynchronous gradient all-reduce running under backward is hidden; its tail after backward
   ends is exposed.
4. **data** — "data" phase spans (waiting for the batch), minus the above.
5. **optimizer** — the optimizer phase, minus the above (ZeRO's parameter all-gather or the
   gradient-norm all-reduce inside it count as communication).
6. **host_other** — the rest: gaps between phases, gradient-sync bookkeeping, Python overhead.

Intervals are nanosecond `(start, end)` pairs; the step is clipped to its own span. A class
whose spans a runtime does not emit (no pipeline → no bubble) is simply zero.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from plait.daemon import telemetry_schema as schema

Interval = tuple[int, int]

CLASSES = ("compute", "exposed_comm", "data", "pipeline_bubble", "optimizer", "host_other")
COMPUTE_PHASES = schema.COMPUTE_PHASES
BUBBLE_PHASES = schema.BUBBLE_PHASES
DATA_PHASES = schema.DATA_PHASES
OPTIMIZER_PHASES = schema.OPTIMIZER_PHASES


# --------------------------------------------------------------------------------------------
# interval arithmetic on sorted, disjoint lists
# --------------------------------------------------------------------------------------------


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as a sorted list of disjoint, non-empty intervals."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def subtract(keep: Sequence[Interval], remove: Sequence[Interval]) -> list[Interval]:
    """`keep` minus `remove`; both sorted and disjoint (as `merge` returns them)."""
    out: list[Interval] = []
    j = 0
    for start, end in keep:
        while j < len(remove) and remove[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(remove) and remove[k][0] < end:
            if remove[k][0] > cursor:
                out.append((cursor, remove[k][0]))
            cursor = max(cursor, remove[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    return subtract(a, subtract(a, b))


def total_ns(intervals: Iterable[Interval]) -> int:
    return sum(end - start for start, end in intervals)


# --------------------------------------------------------------------------------------------
# one step
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)  # not frozen: one per received span, frozen __init__ is slow
class StepSpan:
    """What the analysis needs of a received span: a phase or a comm op of one step."""

    kind: str  # "phase" or "comm"
    name: str  # phase name, or comm op
    start_ns: int
    end_ns: int
    purpose: str = ""
    blocking: bool = False  # a synchronous collective
    nbytes: int = 0
    # Bytes this op put on the wire inside the node and across nodes (backend-carried ops only).
    intra_node: int = 0
    inter_node: int = 0


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    step: int
    step_seconds: float
    seconds: dict[str, float]  # class -> seconds, summing to step_seconds
    comm_seconds: float  # all communication, overlapped or not
    exposed_comm_by_purpose: dict[str, float]
    microbatches: int
    # purpose -> the collective ops issued for it: what already runs (reduce-scatters of
    # "tp_activation" are sequence parallelism, "param_gather" is ZeRO).
    comm_ops_by_purpose: dict[str, frozenset[str]] = field(default_factory=dict)


def _clip(intervals: Iterable[Interval], lo: int, hi: int) -> list[Interval]:
    return merge((max(s, lo), min(e, hi)) for s, e in intervals)


def step_breakdown(
    step: int, start_ns: int, end_ns: int, spans: Sequence[StepSpan]
) -> StepBreakdown:
    """Split the step [start_ns, end_ns) into the classes of this module's docstring."""

    def phases(wanted: frozenset[str]) -> list[Interval]:
        return _clip(
            ((s.start_ns, s.end_ns) for s in spans if s.kind == "phase" and s.name in wanted),
            start_ns,
            end_ns,
        )

    comm_spans = sorted((s for s in spans if s.kind == "comm"), key=lambda s: s.start_ns)
    comm = _clip(((s.start_ns, s.end_ns) for s in comm_spans), start_ns, end_ns)
    blocking = _clip(((s.start_ns, s.end_ns) for s in comm_spans if s.blocking), start_ns, end_ns)

    compute = subtract(phases(COMPUTE_PHASES), blocking)
    taken = compute
    bubble = subtract(phases(BUBBLE_PHASES), taken)
    taken = merge([*taken, *bubble])
    exposed = subtract(comm, taken)
    taken = merge([*taken, *exposed])
    data = subtract(phases(DATA_PHASES), taken)
    taken = merge([*taken, *data])
    optimizer = subtract(phases(OPTIMIZER_PHASES), taken)
    taken = merge([*taken, *optimizer])
    step_ns = max(end_ns - start_ns, 0)

    # Exposed time goes to the purpose of the op that was running first, so purposes add up.
    by_purpose: dict[str, float] = {}
    remaining = exposed
    for span in comm_spans:
        if not remaining:
            break
        own = intersect(remaining, _clip([(span.start_ns, span.end_ns)], start_ns, end_ns))
        if own:
            purpose = span.purpose or "generic"
            by_purpose[purpose] = by_purpose.get(purpose, 0.0) + total_ns(own) / 1e9
            remaining = subtract(remaining, own)

    seconds = {
        "compute": total_ns(compute) / 1e9,
        "exposed_comm": total_ns(exposed) / 1e9,
        "data": total_ns(data) / 1e9,
        "pipeline_bubble": total_ns(bubble) / 1e9,
        "optimizer": total_ns(optimizer) / 1e9,
        "host_other": (step_ns - total_ns(taken)) / 1e9,
    }
    microbatches = sum(1 for s in spans if s.kind == "phase" and s.name == schema.PHASE_FORWARD)
    ops: dict[str, set[str]] = {}
    for span in comm_spans:
        ops.setdefault(span.purpose or "generic", set()).add(span.name)
    return StepBreakdown(
        step=step,
        step_seconds=step_ns / 1e9,
        seconds=seconds,
        comm_seconds=total_ns(comm) / 1e9,
        exposed_comm_by_purpose=by_purpose,
        microbatches=microbatches,
        comm_ops_by_purpose={purpose: frozenset(names) for purpose, names in ops.items()},
    )


# --------------------------------------------------------------------------------------------
# a rank over a window of steps
# --------------------------------------------------------------------------------------------

# How each class is named to a person (tables, the dominant column, advice lines, pictures).
CLASS_LABELS = {
    "compute": "compute",
    "exposed_comm": "exposed comm",
    "data": "data",
    "pipeline_bubble": "bubble",
    "optimizer": "optimizer",
    "host_other": "host/other",
}


@dataclass(frozen=True, slots=True)
class RankContext:
    """What the advice can use about a rank beyond its spans: the mesh and the device."""

    degrees: Mapping[str, int] = field(default_factory=dict)
    comm_bytes_by_purpose: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    # purpose -> (ops per step, mean bytes per op)
    device: str = ""  # "cpu", "cuda:0"; "" when the producer did not say
    compute_dtype: str = ""  # "float32", "bfloat16", ...
    # Mixture of experts (0 / "" when the job reports no expert load): the worst layer's
    # busiest-expert tokens over the mean, and the largest share of assignments dropped.
    expert_imbalance: float = 0.0
    expert_layer: str = ""
    expert_dropped_fraction: float = 0.0
    # Bytes sent per step inside the node and across nodes (the job's sum for job advice).
    comm_link_bytes: tuple[int, int] = (0, 0)


@dataclass(frozen=True, slots=True)
class RankBreakdown:
    steps: int
    step_seconds: float  # mean
    seconds: dict[str, float]  # mean per step
    comm_seconds: float
    exposed_comm_by_purpose: dict[str, float]
    median_step_seconds: float
    median_compute_seconds: float
    microbatches: int
    comm_ops_by_purpose: dict[str, frozenset[str]] = field(default_factory=dict)

    @property
    def dominant(self) -> str:
        if not self.steps:
            return ""
        return max(CLASSES, key=lambda c: self.seconds[c])


def _union_ops(items: Iterable[Mapping[str, frozenset[str]]]) -> dict[str, frozenset[str]]:
    ops: dict[str, frozenset[str]] = {}
    for item in items:
        for purpose, names in item.items():
            ops[purpose] = ops.get(purpose, frozenset()) | names
    return ops


def rank_breakdown(steps: Sequence[StepBreakdown]) -> RankBreakdown:
    """Means per step over `steps`, plus the medians the straggler detector compares."""
    count = len(steps)
    if not count:
        return RankBreakdown(0, 0.0, dict.fromkeys(CLASSES, 0.0), 0.0, {}, 0.0, 0.0, 0)
    purposes: dict[str, float] = {}
    for step in steps:
        for purpose, value in step.exposed_comm_by_purpose.items():
            purposes[purpose] = purposes.get(purpose, 0.0) + value / count
    return RankBreakdown(
        steps=count,
        step_seconds=sum(s.step_seconds for s in steps) / count,
        seconds={c: sum(s.seconds[c] for s in steps) / count for c in CLASSES},
        comm_seconds=sum(s.comm_seconds for s in steps) / count,
        exposed_comm_by_purpose=purposes,
        median_step_seconds=statistics.median(s.step_seconds for s in steps),
        median_compute_seconds=statistics.median(s.seconds["compute"] for s in steps),
        microbatches=max(s.microbatches for s in steps),
        comm_ops_by_purpose=_union_ops(s.comm_ops_by_purpose for s in steps),
    )


def job_dominant(breakdowns: Iterable[RankBreakdown]) -> RankBreakdown:
    """The job's typical rank: the mean over its ranks of their per-step means.

    A mean, not a sum: the job's dominant class is the same either way, but every figure
    the advice quotes must be one a person finds in the per-rank table (220 ms of exposed
    communication per rank is not "440 ms" because two ranks wait at once).
    """
    items = [b for b in breakdowns if b.steps]
    if not items:
        return rank_breakdown([])
    n = len(items)
    purposes: dict[str, float] = {}
    for b in items:
        for purpose, value in b.exposed_comm_by_purpose.items():
            purposes[purpose] = purposes.get(purpose, 0.0) + value / n
    return RankBreakdown(
        steps=min(b.steps for b in items),
        step_seconds=sum(b.step_seconds for b in items) / n,
        seconds={c: sum(b.seconds[c] for b in items) / n for c in CLASSES},
        comm_seconds=sum(b.comm_seconds for b in items) / n,
        exposed_comm_by_purpose=purposes,
        median_step_seconds=statistics.median(b.median_step_seconds for b in items),
        median_compute_seconds=statistics.median(b.median_compute_seconds for b in items),
        microbatches=max(b.microbatches for b in items),
        comm_ops_by_purpose=_union_ops(b.comm_ops_by_purpose for b in items),
    )


# --------------------------------------------------------------------------------------------
# advice: only what can help on this device and is not already on
# --------------------------------------------------------------------------------------------

LOW_PRECISION_DTYPES = frozenset({"bfloat16", "float16"})


@dataclass(frozen=True, slots=True)
class RunFacts:
    """What the advice must know so it never suggests what cannot help or already runs."""

    on_gpu: bool  # CUDA: Triton kernels, bf16 tensor cores, CUDA graphs, pinned memory help
    on_cpu: bool  # CPU: none of those do (bf16 matmuls are slower than fp32 on most CPUs)
    low_precision: bool  # computes in bf16/fp16 already
    sequence_parallel: bool  # tensor-parallel activations are reduce-scattered
    zero_sharded: bool  # ZeRO gathers parameters: optimizer state is sharded already
    grad_sync_algorithm: str  # the comm algorithm the gradient buckets run through, or ""
    degrees: Mapping[str, int]

    @classmethod
    def of(cls, breakdown: RankBreakdown, context: RankContext) -> RunFacts:
        ops = breakdown.comm_ops_by_purpose
        bases = {purpose.rsplit("/", 1)[-1]: purpose for purpose in ops}
        tp_ops = frozenset().union(
            *(names for purpose, names in ops.items() if purpose.endswith("tp_activation"))
        )
        bucket = bases.get("grad_bucket", "")
        return cls(
            on_gpu=context.device.startswith("cuda"),
            on_cpu=context.device == "cpu",
            low_precision=context.compute_dtype in LOW_PRECISION_DTYPES,
            sequence_parallel="reduce_scatter" in tp_ops,
            zero_sharded="param_gather" in bases,
            grad_sync_algorithm=bucket.rsplit("/", 1)[0] if "/" in bucket else "",
            degrees=context.degrees,
        )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _join(items: Sequence[str]) -> str:
    items = [i for i in items if i]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " or " + items[-1]


def _cross_node(context: RankContext, facts: RunFacts) -> str:
    """When most bytes crossed nodes: say so, and what moves traffic off the slow link."""
    intra, inter = context.comm_link_bytes
    if inter <= intra:
        return ""
    remedies = ["keep tp, cp and ep groups inside a node"]
    if facts.grad_sync_algorithm != "hierarchical":
        remedies.insert(
            0,
            'comm.algorithm = "hierarchical" (each rank then sends 1/ranks-per-node of the '
            "gradient bytes across nodes)",
        )
    return (
        f"; cross-node traffic: {inter / (intra + inter):.0%} of the bytes cross nodes "
        f"({_mib(inter)} of {_mib(intra + inter)} per step), so the inter-node link sets the "
        f"pace — {_join(remedies)}"
    )


def _comm_advice(breakdown: RankBreakdown, context: RankContext, facts: RunFacts) -> str:
    by_purpose = breakdown.exposed_comm_by_purpose
    purpose = max(by_purpose, key=by_purpose.__getitem__, default="generic")
    exposed = breakdown.seconds["exposed_comm"]
    hidden = 1.0 - exposed / breakdown.comm_seconds if breakdown.comm_seconds > 0 else 0.0
    ops, mean_bytes = context.comm_bytes_by_purpose.get(purpose, (0, 0))
    head = (
        f"exposed communication ({exposed * 1e3:.1f} ms/step per rank, mostly {purpose!r}; "
        f"{hidden:.0%} of all communication overlaps compute)"
    )
    head += _cross_node(context, facts)
    base = purpose.rsplit("/", 1)[-1]
    if base == "grad_bucket":
        sizes = f"{ops} buckets of ~{_mib(mean_bytes)} per step" if ops else "the gradient buckets"
        overlap = (
            "almost none of it runs under backward: launch bucket all-reduces from gradient "
            "hooks (DDP/ZeRO overlap) so they hide behind the remaining backward; "
            if hidden < 0.3
            else ""
        )
        remedies = [
            "raise the bucket size (ddp.bucket_mb / zero bucket; ~25 MiB amortises "
            "per-collective latency) if buckets are small",
            "accumulate more micro-batches per step so each sync covers more compute",
        ]
        if not facts.grad_sync_algorithm:
            remedies.append(
                "compress gradients (compression plugin: bf16 or PowerSGD) if the link is "
                "bandwidth-bound"
            )
        else:
            remedies.append(
                f"check the {facts.grad_sync_algorithm!r} algorithm the buckets already run "
                "through suits this link"
            )
        return f"{head}: {overlap}{sizes} — {_join(remedies)}."
    if base == "param_gather":
        return (
            f"{head}: ZeRO parameter all-gathers wait on the critical path — prefetch the "
            "next unit earlier, use larger units, or use ZeRO stage 2 if the parameters fit "
            "in memory (stage 2 gathers nothing during forward)."
        )
    if base in ("tp_activation", "tp_grad"):
        tp = facts.degrees.get("tp", 1)
        link = " (NVLink/NVSwitch)" if facts.on_gpu else ""
        remedies = [f"keep tp={tp} inside one node{link}, never across the network"]
        remedies.append("if it already is, lower tp and raise dp or pp")
        if not facts.sequence_parallel:
            remedies.append("enable sequence parallel (tp.sequence_parallel) to shrink activations")
        return f"{head}: tensor-parallel collectives are synchronous by design — {_join(remedies)}."
    if base in ("grad_norm", "metrics", "loss_scale"):
        return (
            f"{head}: small synchronous all-reduces are latency-bound — report loss/metrics "
            "less often (train.log_every) and fuse the gradient-norm reduction with the "
            "gradient sync."
        )
    if base in ("cp_kv", "cp_a2a"):
        cp = facts.degrees.get("cp", 1)
        how = (
            "ring K/V transfers outlast the attention block they overlap"
            if base == "cp_kv"
            else "Ulysses all-to-alls are synchronous"
        )
        return (
            f"{head}: context parallelism (cp={cp}): {how} — keep the cp group inside a node, "
            "lengthen the sequence per rank (lower cp) so each block carries more compute, or "
            "use hybrid (Ulysses inside a node, ring across nodes)."
        )
    if base in ("moe_dispatch", "moe_combine"):
        return (
            f"{head}: expert-parallel all-to-alls wait on the critical path — keep the ep group "
            "inside a node, lower parallel.ep, or balance the experts' load (a higher "
            "aux_loss_coef, or bias_update_rate) so no rank waits for the busiest expert."
        )
    if base == "optimizer_state":
        return f"{head}: optimizer-state gathers belong in checkpointing, not in every step."
    return (
        f"{head}: overlap collectives with compute (async ops), use larger messages, or keep "
        "the heaviest group inside a node."
    )


def advice(breakdown: RankBreakdown, context: RankContext | None = None) -> str:
    """Concrete advice for the dominant class of `breakdown`, for the device it ran on.

    Figures quoted are `breakdown`'s own (per rank and step, as the tables show them); a
    remedy is left out when it cannot help on the rank's device or is already on.
    """
    context = context or RankContext()
    dominant = breakdown.dominant
    if not dominant:
        return "no complete steps received yet"
    facts = RunFacts.of(breakdown, context)
    share = breakdown.seconds[dominant] / breakdown.step_seconds if breakdown.step_seconds else 0
    ms = breakdown.seconds[dominant] * 1e3
    if dominant == "exposed_comm":
        return _comm_advice(breakdown, context, facts)
    if dominant == "data":
        prefetch = "prefetch in background workers" + (
            " with pinned host memory" if facts.on_gpu else ""
        )
        return (
            f"data-bound: {ms:.1f} ms/step ({share:.0%}) waiting for batches — {prefetch}, "
            "read memory-mapped token files (`plait data prepare`) instead of tokenising on "
            "the fly, or raise the micro-batch size so each batch carries more compute."
        )
    if dominant == "pipeline_bubble":
        pp = facts.degrees.get("pp", 1)
        m = max(breakdown.microbatches, 1)
        bubble = (pp - 1) / (m + pp - 1) if pp > 1 else 0.0
        return (
            f"pipeline bubble: {ms:.1f} ms/step ({share:.0%}) idle or waiting on the next "
            f"stage — with pp={pp} and {m} micro-batches the 1F1B bubble is "
            f"(p-1)/(m+p-1) = {bubble:.0%}; raise the micro-batch count (m >= 4p keeps it "
            "under ~20%), use interleaved 1F1B (virtual stages) or the zero-bubble ZB-H1 "
            "schedule, and balance layers across stages."
        )
    if dominant == "optimizer":
        remedies = ["use the fused AdamW kernel (kernels.adamw_step)"]
        if facts.degrees.get("dp", 1) > 1 and not facts.zero_sharded:
            remedies.append(
                "shard optimizer state with ZeRO stage 1/2 (parallel.dp_strategy; each rank "
                "updates 1/dp of the parameters)"
            )
        remedies.append("avoid CPU offload unless memory forces it")
        return (
            f"optimizer-bound: {ms:.1f} ms/step ({share:.0%}) in the optimizer step — "
            f"{_join(remedies)}."
        )
    if dominant == "host_other":
        graphs = "torch.compile or CUDA graphs" if facts.on_gpu else "torch.compile"
        return (
            f"host overhead: {ms:.1f} ms/step ({share:.0%}) outside compute, communication and "
            f"data — Python and launch overhead or host syncs between phases; use {graphs}, "
            "larger micro-batches, and fewer per-step .item() calls."
        )
    remedies = []
    if facts.on_gpu:
        remedies.append('fused Triton kernels (kernels.prefer = ["triton"])')
        if not facts.low_precision:
            remedies.append("bf16 autocast (the precision plugin)")
    elif facts.on_cpu:
        # Triton needs a GPU, and bf16 matmuls run slower than fp32 on most CPUs.
        remedies.append("more cores per rank (fewer ranks per node)")
    remedies.append("larger micro-batches")
    return (
        f"compute-bound ({share:.0%} of the step): the healthy case — raise MFU with "
        f"{_join(remedies)}; use activation checkpointing only where memory requires it."
    )


# --------------------------------------------------------------------------------------------
# mixture of experts: expert load, said beside whatever dominates
# --------------------------------------------------------------------------------------------

EXPERT_IMBALANCE_NOTED = 1.25  # busiest expert 25 % over the mean
EXPERT_DROPS_NOTED = 0.01  # 1 % of assignments dropped over capacity
MOE_PURPOSES = ("moe_dispatch", "moe_combine")


def expert_load_advice(breakdown: RankBreakdown, context: RankContext) -> str:
    """What the expert load costs and how to even it, when it is uneven or drops tokens.

    Names the exposed all-to-all time of expert dispatch and combine (per rank and step, as
    the tables show it) when it is the largest exposed communication; "" for a balanced or
    dense model.
    """
    imbalance, dropped = context.expert_imbalance, context.expert_dropped_fraction
    if not breakdown.steps or (imbalance < EXPERT_IMBALANCE_NOTED and dropped < EXPERT_DROPS_NOTED):
        return ""
    by_purpose = breakdown.exposed_comm_by_purpose
    a2a = sum(v for p, v in by_purpose.items() if p.rsplit("/", 1)[-1] in MOE_PURPOSES)
    head = f"expert load: in {context.expert_layer or 'a MoE layer'} the busiest expert gets "
    head += f"{imbalance:.2f}× the mean tokens"
    if dropped >= EXPERT_DROPS_NOTED:
        head += f", {dropped:.1%} of assignments dropped over capacity"
    if a2a > 0 and a2a >= max(by_purpose.values(), default=0.0):
        head += f"; expert all-to-all exposes {a2a * 1e3:.1f} ms/step per rank"
    remedies = [
        "raise the balancing coefficient (model.aux_loss_coef) or the routing-bias update "
        "(model.bias_update_rate)"
    ]
    if dropped >= EXPERT_DROPS_NOTED:
        remedies.append("raise model.capacity_factor (fewer drops, more memory and bytes)")
    if context.degrees.get("ep", 1) > 1:
        remedies.append(
            f"lower parallel.ep={context.degrees['ep']} so fewer ranks wait for the busiest one"
        )
    return f"{head} — {_join(remedies)}."
