"""`plait plan explain`: the prediction for a finished run against what the daemon measured.

The daemon's bottleneck breakdown splits each rank's step into compute, exposed communication
(and that by purpose), pipeline bubble, optimizer, data wait and host overhead. The planner's
terms map onto them (compute + recomputation → compute; tp / cp / ep / dp comm → exposed comm,
split by purpose where the spans say which; bubble → bubble; optimizer → optimizer; the
strategies' fixed host costs → host overhead), and the
term with the largest error in seconds is the one that was off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from plait.core import comm_algorithms as comm
from plait.planner.time_model import StepTimeEstimate

# The daemon's comm purposes (`plait.core.comm_algorithms`), by the planner term they belong to;
# pipeline transfers are part of the bubble term, the rest (metrics, norms) of none.
PURPOSE_TERMS = {
    comm.GRAD_BUCKET: "dp_comm",
    comm.GRAD_SHARD: "dp_comm",  # HSDP's gradient shards averaged across the replicas
    comm.PARAM_GATHER: "dp_comm",
    comm.TP_ACTIVATION: "tp_comm",
    comm.TP_GRAD: "tp_comm",
    comm.CP_KV: "cp_comm",
    comm.CP_A2A: "cp_comm",
    comm.MOE_DISPATCH: "ep_comm",
    "activation": "pipeline_bubble",
    "activation_grad": "pipeline_bubble",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class TermComparison:
    term: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        return self.predicted - self.measured


@dataclass(frozen=True, slots=True, kw_only=True)
class Explanation:
    rows: tuple[TermComparison, ...]
    predicted_step: float
    measured_step: float
    ranks: int

    @property
    def worst(self) -> TermComparison:
        return max(self.rows, key=lambda r: abs(r.error))

    def verdict(self) -> str:
        worst = self.worst
        direction = "over" if worst.error > 0 else "under"
        ratio = worst.predicted / worst.measured if worst.measured > 0 else float("inf")
        return (
            f"{worst.term} was off most: predicted {worst.predicted * 1e3:.1f} ms, measured "
            f"{worst.measured * 1e3:.1f} ms per step ({direction}estimated, {ratio:.2f}×)"
        )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def explain(prediction: StepTimeEstimate, ranks: Sequence[Any]) -> Explanation:
    """Compare `prediction` with the mean of the ranks' breakdowns (`BottleneckBreakdown`)."""
    if not ranks:
        raise ValueError("the daemon reported no step breakdown (no steps in its window?)")
    terms = prediction.terms()
    measured_comm: dict[str, float] = {}
    unassigned = 0.0
    for rank in ranks:
        by_purpose = dict(rank.exposed_comm_by_purpose)
        assigned = 0.0
        for purpose, seconds in by_purpose.items():
            # an algorithm's sub-ops ("hierarchical/grad_bucket") count for their parent's term
            term = PURPOSE_TERMS.get(purpose, PURPOSE_TERMS.get(purpose.rpartition("/")[2]))
            if term is None or term == "pipeline_bubble":
                continue
            measured_comm[term] = measured_comm.get(term, 0.0) + seconds / len(ranks)
            assigned += seconds
        unassigned += max(rank.exposed_comm_seconds - assigned, 0.0) / len(ranks)
    comm_terms = ("tp_comm", "cp_comm", "ep_comm", "dp_comm")
    rows = [
        TermComparison(
            term="compute",
            predicted=terms["compute"] + terms["recompute"],
            measured=_mean([r.compute_seconds for r in ranks]),
        ),
        TermComparison(
            term="pipeline_bubble",
            predicted=terms["pipeline_bubble"],
            measured=_mean([r.pipeline_bubble_seconds for r in ranks]),
        ),
        TermComparison(
            term="optimizer",
            # offload's copies run in the optimizer step's hooks, measured as part of it
            predicted=terms["optimizer"] + terms["offload"],
            measured=_mean([r.optimizer_seconds for r in ranks]),
        ),
        TermComparison(
            term="host_other+data",
            # a saving step's wait runs outside the model's compute and comm
            predicted=terms["host_overhead"] + terms["checkpoint"],
            measured=_mean([r.host_other_seconds + r.data_wait_seconds for r in ranks]),
        ),
    ]
    if measured_comm:
        for term in comm_terms:
            if terms[term] or term in measured_comm:
                rows.append(
                    TermComparison(
                        term=term, predicted=terms[term], measured=measured_comm.get(term, 0.0)
                    )
                )
        if unassigned:
            rows.append(TermComparison(term="other comm", predicted=0.0, measured=unassigned))
    else:
        rows.append(
            TermComparison(
                term="exposed_comm",
                predicted=sum(terms[t] for t in comm_terms),
                measured=_mean([r.exposed_comm_seconds for r in ranks]),
            )
        )
    return Explanation(
        rows=tuple(rows),
        predicted_step=prediction.total,
        measured_step=_mean([r.step_seconds for r in ranks]),
        ranks=len(ranks),
    )
