"""Model FLOPs utilisation: the one formula the ranks, the daemon, the CLI and the trainer use.

    MFU = achieved model FLOP/s ÷ peak FLOP/s of the same devices

Achieved FLOP/s counts model FLOPs only (`plait.core.flops`: 6·N + attention per token;
recomputation is not model work). The peak comes from `plait.daemon.peak_flops`.

Two outcomes are not figures:

* peak unknown (0, negative or NaN): MFU is reported as 0 (`UNKNOWN`);
* MFU above 100 %: no device beats its own peak, so the peak is wrong (a stale or disturbed
  CPU calibration, a table entry for another device). It is reported as `CALIBRATION_ERROR`
  (-1), which `format_mfu` prints as "calibration error" and `is_calibration_error` tests;
  it is never shown as a percentage.

Over step samples, for one rank r over a window of steps S (each step s reports the whole job's
training FLOPs F_s = flops_per_token × tokens_s, and the rank's step wall time t_{r,s}):

    achieved_r = Σ_s (F_s / W) / Σ_s t_{r,s}        W = world size: each rank's share of the job
    MFU_r      = achieved_r / P_r                      P_r = peak FLOP/s of rank r's device

For the job, over the steps S that every reporting rank R has finished, a step lasts as long
as its slowest rank (T_s = max_r t_{r,s}):

    achieved_job = Σ_s F_s · |R|/W / Σ_s T_s
    MFU_job      = achieved_job / Σ_{r∈R} P_r

When one daemon sees every rank (|R| = W), MFU_job = Σ F_s / (Σ T_s · Σ P_r). When ranks report
to several daemons (one per node), achieved and peak add up across daemons before dividing,
which is how the CLI aggregates hosts (`mfu(Σ achieved, Σ peak)`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

UNKNOWN = 0.0
CALIBRATION_ERROR = -1.0


def mfu(achieved_flops_per_second: float, peak_flops_per_second: float) -> float:
    """Achieved over peak, in [0, 1]; `UNKNOWN` without a peak, `CALIBRATION_ERROR` above 1."""
    if not peak_flops_per_second > 0 or not math.isfinite(peak_flops_per_second):
        return UNKNOWN
    if not achieved_flops_per_second > 0 or not math.isfinite(achieved_flops_per_second):
        return 0.0
    ratio = achieved_flops_per_second / peak_flops_per_second
    return CALIBRATION_ERROR if ratio > 1.0 else ratio


def is_calibration_error(value: float) -> bool:
    return value < 0


def format_mfu(value: float) -> str:
    """ "42.1%", or "calibration error" for an MFU above 100 %."""
    return "calibration error" if is_calibration_error(value) else f"{value:.1%}"


CALIBRATION_ADVICE = (
    "MFU above 100 %: the peak FLOP/s is too low for what the device did; on CPU run "
    "`plait calibrate --force` on an idle host, on a GPU check the device name's table entry"
)


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
