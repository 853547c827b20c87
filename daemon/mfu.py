"""Model FLOPs utilisation: the formula, as small pure functions over step samples.

For one rank r over a window of steps S (each step s reports the whole job's training FLOPs
F_s = flops_per_token × tokens_s, and the rank's step wall time t_{r,s}):

    achieved_r = Σ_s (F_s / W) / Σ_s t_{r,s}        W = world size: each rank's share of the job
    MFU_r      = achieved_r / P_r                      P_r = peak FLOP/s of rank r's device

For the job, over the steps S that every reporting rank R has finished, a step lasts as long
as its slowest rank (T_s = max_r t_{r,s}):

    achieved_job = Σ_s F_s · |R|/W / Σ_s T_s
    MFU_job      = achieved_job / Σ_{r∈R} P_r

When this daemon sees every rank (|R| = W), MFU_job = Σ F_s / (Σ T_s · Σ P_r): the usual
"model FLOPs per second over peak FLOPs per second of all devices". When ranks report to
several daemons (one per node), achieved and peak add up across daemons, which is how the CLI
aggregates hosts. P_r is a dense datasheet figure on accelerators and a GEMM calibration on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepSample:
    """One rank's view of one optimizer step."""

    step: int
    seconds: float
    model_flops: float  # whole job, this step
    tokens: int  # whole job, this step
    world_size: int


@dataclass(frozen=True, slots=True)
class Throughput:
    steps: int
    step_seconds: float  # mean
    tokens_per_second: float
    model_flops_per_second: float
    peak_flops: float
    mfu: float


EMPTY = Throughput(0, 0.0, 0.0, 0.0, 0.0, 0.0)


def mfu(achieved_flops_per_second: float, peak_flops_per_second: float) -> float:
    """Achieved over peak; 0 when the peak is unknown."""
    if not peak_flops_per_second > 0:  # also NaN
        return 0.0
    return achieved_flops_per_second / peak_flops_per_second


def rank_throughput(samples: Sequence[StepSample], peak_flops: float) -> Throughput:
    """MFU_r and rates of one rank over `samples` (its last steps)."""
    seconds = sum(s.seconds for s in samples)
    if not samples or seconds <= 0:
        return Throughput(len(samples), 0.0, 0.0, 0.0, peak_flops, 0.0)
    # The decoder admits world_size >= 1 only; max() keeps a zero from any other caller harmless.
    flops = sum(s.model_flops / max(s.world_size, 1) for s in samples)
    tokens = sum(s.tokens / max(s.world_size, 1) for s in samples)
    achieved = flops / seconds
    return Throughput(
        steps=len(samples),
        step_seconds=seconds / len(samples),
        tokens_per_second=tokens / seconds,
        model_flops_per_second=achieved,
        peak_flops=peak_flops,
        mfu=mfu(achieved, peak_flops),
    )


def job_throughput(
    samples_by_rank: Mapping[int, Sequence[StepSample]],
    peak_by_rank: Mapping[int, float],
    *,
    window_steps: int,
) -> Throughput:
    """MFU_job over the last `window_steps` steps that every rank in `samples_by_rank` finished."""
    if not samples_by_rank:
        return EMPTY
    by_rank = {rank: {s.step: s for s in samples} for rank, samples in samples_by_rank.items()}
    common = set.intersection(*(set(steps) for steps in by_rank.values()))
    steps = sorted(common)[-window_steps:] if window_steps > 0 else sorted(common)
    peak = sum(peak_by_rank.get(rank, 0.0) for rank in by_rank)
    if not steps:
        return Throughput(0, 0.0, 0.0, 0.0, peak, 0.0)
    world_size = next(iter(by_rank[next(iter(by_rank))].values())).world_size
    share = len(by_rank) / max(world_size, 1)
    total_seconds = 0.0
    flops = tokens = 0.0
    for step in steps:
        views = [by_rank[rank][step] for rank in by_rank]
        total_seconds += max(v.seconds for v in views)
        # F_s is the whole job's count, identical on every rank; take the largest in case a
        # rank reported a skipped step as zero.
        flops += max(v.model_flops for v in views) * share
        tokens += max(v.tokens for v in views) * share
    if total_seconds <= 0:
        return Throughput(len(steps), 0.0, 0.0, 0.0, peak, 0.0)
    achieved = flops / total_seconds
    return Throughput(
        steps=len(steps),
        step_seconds=total_seconds / len(steps),
        tokens_per_second=tokens / total_seconds,
        model_flops_per_second=achieved,
        peak_flops=peak,
        mfu=mfu(achieved, peak),
    )
