"""Straggler detection: each rank's median step and compute time against the job's medians.

In synchronous training every rank's *step* time converges to the slowest rank's (the others
wait for it inside the gradient collective), so step time alone rarely names the straggler;
*compute* time (the bottleneck analysis' compute class) does: the slow rank computes longer,
the fast ones wait in exposed communication. Both are scored:

    step_score_r    = median_r(step)    / median over ranks(median_r(step))    - 1
    compute_score_r = median_r(compute) / median over ranks(median_r(compute)) - 1

and a rank is flagged when max(step_score, compute_score) > threshold (0.2: 20% slower than
the job's median rank). Medians make one slow step (a checkpoint, a GC pause) harmless.

The function is pure over `RankTiming`s so the CLI can score ranks gathered from several
daemons (one per node) exactly as a daemon scores the ranks it sees.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from plait.daemon.config import DEFAULT_STRAGGLER_THRESHOLD

DEFAULT_THRESHOLD = DEFAULT_STRAGGLER_THRESHOLD


@dataclass(frozen=True, slots=True)
class RankTiming:
    job_id: str
    rank: int
    host: str
    steps: int
    median_step_seconds: float
    median_compute_seconds: float
    replica_group: int = -1  # in a fault-tolerant job: the group that numbers `rank`


@dataclass(frozen=True, slots=True)
class StragglerScore:
    timing: RankTiming
    step_score: float
    compute_score: float
    flagged: bool

    @property
    def score(self) -> float:
        return max(self.step_score, self.compute_score)


def _relative(value: float, reference: float) -> float:
    return value / reference - 1.0 if reference > 0 else 0.0


def score_ranks(
    timings: Iterable[RankTiming], threshold: float = DEFAULT_THRESHOLD
) -> list[StragglerScore]:
    """Scores per rank, each job against its own medians; sorted by job, then rank."""
    by_job: dict[str, list[RankTiming]] = {}
    for timing in timings:
        if timing.steps > 0:
            by_job.setdefault(timing.job_id, []).append(timing)
    scores: list[StragglerScore] = []
    for _, ranks in sorted(by_job.items()):
        step_median = statistics.median(t.median_step_seconds for t in ranks)
        compute_median = statistics.median(t.median_compute_seconds for t in ranks)
        for timing in sorted(ranks, key=lambda t: t.rank):
            step_score = _relative(timing.median_step_seconds, step_median)
            compute_score = _relative(timing.median_compute_seconds, compute_median)
            scores.append(
                StragglerScore(
                    timing=timing,
                    step_score=step_score,
                    compute_score=compute_score,
                    # One rank alone has no peers to straggle behind.
                    flagged=len(ranks) > 1 and max(step_score, compute_score) > threshold,
                )
            )
    return scores
