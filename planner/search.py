"""The search: enumerate layouts, drop those that do not fit, rank by predicted step time.

`plan` prices every layout `enumerate_layouts` allows and returns them fastest first, one per
mesh (tp, cp, pp, dp, ep) by default: the knobs inside a mesh (ZeRO stage, micro-batch,
schedule, recomputation, sp) are tuned to that mesh's fastest fitting choice, which is how
published layouts are stated. A layout whose ZeRO++ codecs change the numerics ranks by its
step time plus `QUANTIZED_MIN_GAIN` (it must be that much faster to win). `why_slower` names the
terms that make a layout lose to the best.

Offload (`[zero.offload]`) is a second pass: only when no layout fits the device does `plan`
try the ZeRO layouts with their optimizer state (and stage 3's parameter shards) on the host
(`SearchSpace.offload`), keeping those whose offloaded state fits the host's share of memory
too. A layout that fits without offload is therefore always preferred, however much faster an
offloaded one might be priced; `PlanResult.offloaded` says the pass was needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from plait.planner.layouts import NO_OFFLOAD, Job, Layout, SearchSpace, enumerate_layouts
from plait.planner.memory_model import MemoryEstimate, estimate_memory, fits_host
from plait.planner.time_model import StepTimeEstimate, estimate_step_time

QUANTIZED_MIN_GAIN = 0.02  # of the predicted step time

TERM_LABELS = {
    "compute": "compute",
    "recompute": "recomputation",
    "tp_comm": "tensor-parallel comm",
    "cp_comm": "context-parallel comm",
    "ep_comm": "expert all-to-all",
    "pipeline_bubble": "pipeline bubble",
    "dp_comm": "data-parallel comm",
    "optimizer": "optimizer step",
    "host_overhead": "host overhead",
    "offload": "offload transfers",
    "checkpoint": "checkpoint saves",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    time: StepTimeEstimate


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    ranked: tuple[Candidate, ...]  # fitting layouts, fastest first
    considered: int
    rejected_for_memory: int
    smallest_rejected: Candidate | None  # the least memory among those that do not fit
    # Whether the ranked layouts offload (no layout fitted without, `[zero.offload]`)
    offloaded: bool = False

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            raise ValueError("no layout fits")
        return self.ranked[0]


def price(job: Job, layout: Layout) -> Candidate:
    return Candidate(
        layout=layout, memory=estimate_memory(job, layout), time=estimate_step_time(job, layout)
    )


def plan(job: Job, space: SearchSpace | None = None, *, per_mesh: bool = True) -> PlanResult:
    """Every valid layout of `job` that fits the device, fastest first; with none, those that
    fit once ZeRO offloads to the host (`SearchSpace.offload`)."""
    space = space or SearchSpace()
    result = _plan_pass(job, space, per_mesh=per_mesh, offload=NO_OFFLOAD)
    if result.ranked or job.device.usable_host_memory is None:
        return result  # nothing to offload to on a device that is its own host (a CPU)
    considered, rejected = result.considered, result.rejected_for_memory
    for device in space.offload:
        offloaded = _plan_pass(job, space, per_mesh=per_mesh, offload=device)
        considered += offloaded.considered
        rejected += offloaded.rejected_for_memory
        if offloaded.ranked:
            return replace(
                offloaded, considered=considered, rejected_for_memory=rejected, offloaded=True
            )
    # The smallest rejected stays the one without offload: what the device alone lacks.
    return replace(result, considered=considered, rejected_for_memory=rejected)


def _plan_pass(job: Job, space: SearchSpace, *, per_mesh: bool, offload: str) -> PlanResult:
    """One pass of the search over the layouts with `offload` ("none": without)."""
    usable, usable_host = job.device.usable_memory, job.device.usable_host_memory
    fitting: list[Candidate] = []
    considered = rejected = 0
    smallest: Candidate | None = None
    for layout in enumerate_layouts(job, space, offload=offload):
        considered += 1
        memory = estimate_memory(job, layout)
        if memory.total > usable or not fits_host(memory, usable_host):
            rejected += 1
            if smallest is None or memory.total < smallest.memory.total:
                smallest = Candidate(
                    layout=layout, memory=memory, time=estimate_step_time(job, layout)
                )
            continue
        fitting.append(
            Candidate(layout=layout, memory=memory, time=estimate_step_time(job, layout))
        )
    # A layout with codecs must buy more than QUANTIZED_MIN_GAIN of the step to rank above an
    # exact one: they perturb weights and gradients. Ties (a gather hidden under compute however
    # few bytes it sends) go to the layout that holds less, then to the exact one.
    fitting.sort(
        key=lambda c: (
            c.time.total * (1 + QUANTIZED_MIN_GAIN if c.layout.quantized else 1),
            c.memory.total,
            c.layout.quantized,
        )
    )
    if per_mesh:
        seen: set[tuple[int, ...]] = set()
        unique = []
        for candidate in fitting:
            if candidate.layout.degrees not in seen:
                seen.add(candidate.layout.degrees)
                unique.append(candidate)
        fitting = unique
    return PlanResult(
        ranked=tuple(fitting),
        considered=considered,
        rejected_for_memory=rejected,
        smallest_rejected=smallest,
    )


def why_slower(candidate: Candidate, best: Candidate, *, top: int = 2) -> str:
    """The terms that cost `candidate` the most time over `best`, e.g. "+38 ms pipeline bubble"."""
    if candidate is best:
        return "fastest"
    if candidate.time.total <= best.time.total:  # ranked second on memory or numerics
        ahead = best.time.total - candidate.time.total
        if candidate.layout.quantized and not best.layout.quantized and ahead > 0:
            gain = f"{QUANTIZED_MIN_GAIN:.0%}"
            return f"{_seconds(ahead)} faster, under {gain}: exact numerics ranked first"
        more = (candidate.memory.total - best.memory.total) / 2**30
        return f"as fast, {more:+.1f} GiB of memory"
    ours, theirs = candidate.time.terms(), best.time.terms()
    deltas = sorted(((ours[k] - theirs[k], k) for k in ours), reverse=True)
    total = candidate.time.total - best.time.total
    parts = [
        f"+{_seconds(delta)} {TERM_LABELS[name]}"
        for delta, name in deltas[:top]
        if delta > 0.05 * max(total, 1e-12)
    ]
    return ", ".join(parts) or f"+{_seconds(total)} in total"


def _seconds(value: float) -> str:
    if value >= 1.0:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} µs"
