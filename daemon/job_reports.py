"""What the operator commands print and the page draws, built from the daemons' answers.

A job's ranks report to several daemons, one per node; `plait top / status / bottleneck /
profile --json` and the daemon's web page combine those answers into one report the same way:
job figures add achieved and peak FLOP/s across daemons (`plait.daemon.mfu`), only the daemons on
the job's newest world count (`plait.daemon.worlds`), stragglers are scored against the medians
of every rank (`plait.daemon.report_messages.rescore_stragglers`), and each report becomes the
JSON document `--json` prints. The CLI draws these reports as tables (`plait.tools.daemon_views`
subclasses them with a `render`); the daemon's page serves the documents. Nothing here imports
the daemon's server side, so a client command starts without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from plait.daemon import json_documents
from plait.daemon.mfu import mfu
from plait.daemon.report_messages import rescore_stragglers
from plait.daemon.worlds import (
    JobAnswers,
    current_ranks,
    split_by_world,
    superseded_jobs,
    without_jobs,
)
from plait.proto.plait.v1 import control_pb2, daemon_pb2, metrics_pb2

if TYPE_CHECKING:
    from plait.daemon.bottleneck import RankBreakdown

HostError = tuple[str, str]  # (address, error text)
Report = TypeVar("Report", bound="BottleneckReport")


def error_text(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'ERROR'}: {details}"


# -- jobs: state, worlds, expert load ------------------------------------------------------------

MAX_WORLDS_SHOWN = 32  # as many as a daemon keeps (plait.daemon.store.MAX_WORLDS_KEPT)

# As plait.daemon.analysis names them (not imported: the CLI starts without the daemon).
RUNNING, FINISHED, FAILED, STALE = "running", "finished", "failed", "stale"


def combined_state(states: Sequence[str]) -> str:
    """One job state from each daemon's: failed wins, then running, then finished by all."""
    known = [s for s in states if s]
    if not known:
        return ""
    if FAILED in known:
        return FAILED
    if RUNNING in known:
        return RUNNING
    if all(s == FINISHED for s in known):
        return FINISHED
    return STALE


@dataclass(frozen=True, slots=True)
class JobWorld:
    state: str = ""
    world_sizes: tuple[int, ...] = ()
    restarts: int = 0
    started_step: int = 0  # first step of the current world, trainer numbering
    ranks_stale: int = 0

    @property
    def worlds(self) -> str:
        """ "2 → 1": the sizes of the job's worlds, oldest first (the last four)."""
        sizes = [str(s) for s in self.world_sizes[-4:]]
        return ("… → " if len(self.world_sizes) > 4 else "") + " → ".join(sizes)


def job_world(answers: JobAnswers) -> JobWorld:
    """One job's world as several daemons see it."""
    current = answers.current
    longest = max(current, key=lambda j: (j.restarts, len(j.world_sizes)))
    sizes, restarts = tuple(longest.world_sizes), longest.restarts
    if answers.older:
        # A daemon that saw only the older world knows where the history began.
        before = max(answers.older, key=lambda j: (j.restarts, len(j.world_sizes)))
        if before.restarts >= restarts:
            sizes = (*before.world_sizes, answers.newest.world_size)[-MAX_WORLDS_SHOWN:]
            restarts = before.restarts + 1
    return JobWorld(
        state=combined_state([j.state for j in current]),
        world_sizes=sizes,
        restarts=restarts,
        started_step=max(j.world_started_step for j in current),
        ranks_stale=sum(j.ranks_stale for j in current),
    )


@dataclass(frozen=True, slots=True)
class ExpertRow:
    job_id: str
    load: metrics_pb2.ExpertLayerLoad


def expert_rows(responses: Sequence[daemon_pb2.GetMetricsResponse]) -> list[ExpertRow]:
    """Each MoE job's layers, from the first daemon on its newest world that reports them."""
    superseded = superseded_jobs({str(i): r for i, r in enumerate(responses)})
    rows: dict[str, list[ExpertRow]] = {}
    for index, response in enumerate(responses):
        for job in response.jobs:
            if job.job_id in superseded[str(index)]:
                continue
            if job.expert_load and job.job_id not in rows:
                rows[job.job_id] = [ExpertRow(job.job_id, layer) for layer in job.expert_load]
    return [row for job_id in sorted(rows) for row in rows[job_id]]


# -- plait top -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobSummary:
    """One job across daemons: achieved and peak FLOP/s add up, the slowest step counts."""

    job_id: str
    ranks_reporting: int
    world_size: int
    step: int
    tokens_per_second: float
    model_flops_per_second: float
    peak_flops: float
    step_seconds: float
    world: JobWorld = field(default_factory=JobWorld)  # state, worlds, restarts
    # Bytes the job's ranks sent per step inside their nodes and across nodes (summed).
    comm_bytes_per_step: dict[str, int] = field(
        default_factory=lambda: {"intra_node": 0, "inter_node": 0}
    )
    # The job's checkpoints (`plait.v1.JobCheckpoints` as JSON: `last`, `writing`, `saves`,
    # `failed`); None for a job that sent none.
    checkpoints: dict[str, Any] | None = None

    @property
    def mfu(self) -> float:
        return mfu(self.model_flops_per_second, self.peak_flops)

    def checkpoint_lines(self) -> list[str]:
        """ "checkpoint: …" lines: the save being written, then the last one (none: no saves)."""
        return checkpoint_lines(self.checkpoints)


def aggregate_jobs(responses: Sequence[daemon_pb2.GetMetricsResponse]) -> list[JobSummary]:
    """Combine the per-daemon job figures of several hosts (see `plait.daemon.mfu`)."""
    by_job: dict[str, list[metrics_pb2.JobMetrics]] = {}
    for response in responses:
        for job in response.jobs:
            by_job.setdefault(job.job_id, []).append(job)
    summaries = []
    for job_id, answers in sorted(by_job.items()):
        # Only daemons on the job's newest world count (`plait.daemon.worlds`).
        split = split_by_world(answers)
        jobs = split.current
        summaries.append(
            JobSummary(
                job_id=job_id,
                ranks_reporting=sum(j.ranks_reporting for j in jobs),
                world_size=split.newest.world_size,
                step=max(j.step for j in jobs),
                tokens_per_second=sum(j.tokens_per_second for j in jobs),
                model_flops_per_second=sum(j.model_flops_per_second for j in jobs),
                peak_flops=sum(j.peak_flops for j in jobs),
                step_seconds=max(j.step_seconds for j in jobs),
                world=job_world(split),
                comm_bytes_per_step={
                    "intra_node": sum(j.comm_bytes_per_step.intra_node for j in jobs),
                    "inter_node": sum(j.comm_bytes_per_step.inter_node for j in jobs),
                },
                checkpoints=job_checkpoints(answers),
            )
        )
    return summaries


# -- checkpoints ---------------------------------------------------------------------------------


def job_checkpoints(answers: Sequence[metrics_pb2.JobMetrics]) -> dict[str, Any] | None:
    """The job's checkpoints from the daemons that heard them (its rank 0's, usually one): the
    last save that ended anywhere, and a save being written unless one ended after it began."""
    reported = [j.checkpoints for j in answers if j.HasField("checkpoints")]
    if not reported:
        return None
    ended = [c.last for c in reported if c.HasField("last")]
    last = max(ended, key=lambda s: s.end_unix_nano, default=None)
    started = [c.writing for c in reported if c.HasField("writing")]
    writing = max(started, key=lambda s: s.start_unix_nano, default=None)
    if writing is not None and last is not None and last.end_unix_nano >= writing.start_unix_nano:
        writing = None
    return {
        "last": json_documents.message_dict(last) if last is not None else None,
        "writing": json_documents.message_dict(writing) if writing is not None else None,
        "saves": sum(c.saves for c in reported),
        "failed": sum(c.failed for c in reported),
    }


def _seconds(value: float) -> str:
    if value >= 1e5:
        return f"{value:.3g} s"
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s" if value >= 1 else f"{value:.2f} s"


def _how(save: Mapping[str, Any]) -> str:
    return "asynchronous" if save["asynchronous"] else "synchronous"


def checkpoint_lines(checkpoints: Mapping[str, Any] | None) -> list[str]:
    """What `plait status` and the page say of a job's checkpoints, from `job_checkpoints`:

    checkpoint: writing step 45 since 0.60 s (asynchronous)
    checkpoint: step 40 saved in 1.8 s (asynchronous, 24.0 MB, the step waited 0.09 s), 12 s ago
    checkpoint: step 40 failed after 0.20 s (asynchronous): OSError: no space left, 3.0 s ago
    """
    if not checkpoints:
        return []
    lines = []
    writing, last = checkpoints.get("writing"), checkpoints.get("last")
    if writing:
        lines.append(
            f"checkpoint: writing step {writing['step']} since "
            f"{_seconds(writing['age_seconds'])} ({_how(writing)})"
        )
    if last:
        ago = f"{_seconds(last['age_seconds'])} ago"
        took = _seconds(last["write_seconds"])
        if last["outcome"] == "failed":
            lines.append(
                f"checkpoint: step {last['step']} failed after {took} ({_how(last)}): "
                f"{last['error'] or 'no error given'}, {ago}"
            )
        else:
            size = f", {last['bytes'] / 1e6:.1f} MB" if last["bytes"] >= 0 else ""
            lines.append(
                f"checkpoint: step {last['step']} saved in {took} ({_how(last)}{size}, "
                f"the step waited {_seconds(last['blocked_seconds'])}), {ago}"
            )
    return lines


@dataclass(frozen=True, slots=True)
class HostRow:
    address: str
    host: metrics_pb2.HostMetrics


@dataclass(frozen=True, slots=True)
class TopReport:
    jobs: list[JobSummary]
    ranks: list[metrics_pb2.RankMetrics]
    hosts: list[HostRow]
    errors: list[HostError]
    experts: list[ExpertRow] = field(default_factory=list)  # one per MoE layer

    @classmethod
    def from_latest(
        cls,
        latest: Mapping[str, daemon_pb2.GetMetricsResponse | str],
        *,
        show_superseded: bool = False,
    ) -> TopReport:
        """The view of each host's latest answer; ranks of a world that another host's
        superseded are marked so, and left out unless `show_superseded`."""
        answered = {h: r for h, r in latest.items() if not isinstance(r, str)}
        responses = list(answered.values())
        ranks = current_ranks(
            {h: r.ranks for h, r in answered.items()},
            superseded_jobs(answered),
            keep_superseded=show_superseded,
        )
        return cls(
            jobs=aggregate_jobs(responses),
            ranks=sorted(ranks, key=lambda r: (r.job_id, r.rank)),
            hosts=[HostRow(a, r.host) for a, r in latest.items() if not isinstance(r, str)],
            errors=[(a, r) for a, r in latest.items() if isinstance(r, str)],
            experts=expert_rows(responses),
        )


def top_document(view: TopReport) -> dict:
    return {
        "jobs": [
            {
                **json_documents.dataclass_dict(j),
                "mfu": j.mfu,
                "checkpoint_lines": j.checkpoint_lines(),
            }
            for j in view.jobs
        ],
        "ranks": [json_documents.message_dict(r) for r in view.ranks],
        "expert_load": [
            {"job_id": e.job_id, **json_documents.message_dict(e.load)} for e in view.experts
        ],
        "hosts": [
            {"address": h.address, "error": None, "host": json_documents.message_dict(h.host)}
            for h in view.hosts
        ]
        + [{"address": a, "error": e, "host": None} for a, e in view.errors],
    }


# -- plait bottleneck ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobVerdict:
    """A job's dominant class and the advice for it, over the ranks of every host."""

    job_id: str
    dominant: str
    advice: str


@dataclass(frozen=True, slots=True)
class BottleneckReport:
    ranks: list[metrics_pb2.BottleneckBreakdown]
    stragglers: list[metrics_pb2.StragglerScore]
    threshold: float
    verdicts: list[JobVerdict]
    errors: list[HostError]


def breakdown_from_message(r: metrics_pb2.BottleneckBreakdown) -> RankBreakdown:
    from plait.daemon.bottleneck import RankBreakdown

    return RankBreakdown(
        steps=r.steps,
        step_seconds=r.step_seconds,
        seconds={
            "compute": r.compute_seconds,
            "exposed_comm": r.exposed_comm_seconds,
            "data": r.data_wait_seconds,
            "pipeline_bubble": r.pipeline_bubble_seconds,
            "optimizer": r.optimizer_seconds,
            "host_other": r.host_other_seconds,
        },
        comm_seconds=r.comm_seconds,
        exposed_comm_by_purpose=dict(r.exposed_comm_by_purpose),
        median_step_seconds=r.median_step_seconds,
        median_compute_seconds=r.median_compute_seconds,
        microbatches=0,
        comm_ops_by_purpose={
            purpose: frozenset(ops.split(",")) for purpose, ops in r.comm_ops_by_purpose.items()
        },
    )


def job_verdicts(
    ranks: Sequence[metrics_pb2.BottleneckBreakdown], infos: Sequence[metrics_pb2.RankInfo]
) -> list[JobVerdict]:
    """One verdict per job over the ranks of every host, advised for the job's device and
    mesh (from `ListRanks`; the lowest rank speaks for the job)."""
    from plait.daemon.bottleneck import RankContext, advice, job_dominant

    by_job: dict[str, list[metrics_pb2.BottleneckBreakdown]] = {}
    for r in ranks:
        by_job.setdefault(r.job_id, []).append(r)
    first: dict[str, metrics_pb2.RankInfo] = {}
    for info in sorted(infos, key=lambda i: i.rank):
        first.setdefault(info.job_id, info)
    verdicts = []
    for job_id, job_ranks in sorted(by_job.items()):
        overall = job_dominant(breakdown_from_message(r) for r in job_ranks)
        if not overall.steps:
            continue
        info = first.get(job_id)
        context = (
            RankContext(
                degrees=dict(info.degrees), device=info.device, compute_dtype=info.compute_dtype
            )
            if info is not None
            else RankContext()
        )
        verdicts.append(JobVerdict(job_id, overall.dominant, advice(overall, context)))
    return verdicts


BottleneckAnswers = tuple[
    daemon_pb2.GetBottleneckResponse, daemon_pb2.ListRanksResponse, daemon_pb2.GetMetricsResponse
]


def bottleneck_report(
    results: Mapping[str, BottleneckAnswers | grpc.RpcError],
    threshold: float,
    report: type[Report] = BottleneckReport,  # type: ignore[assignment]
) -> tuple[Report, list[daemon_pb2.GetMetricsResponse]]:
    """The breakdown of every host's answers (and their metrics, for the figures' titles), as
    `report` (the CLI's subclass draws itself); the daemon's web page builds its panels with
    this too."""
    responses, infos, metrics, errors = [], [], [], []
    answered = {h: r for h, r in results.items() if not isinstance(r, grpc.RpcError)}
    # A host's ranks of a world another host's superseded are no part of the breakdown.
    superseded = superseded_jobs({host: result[2] for host, result in answered.items()})
    for host, result in results.items():
        if isinstance(result, grpc.RpcError):
            errors.append((host, error_text(result)))
            continue
        breakdown, listing, figures = result
        responses.append(without_jobs(breakdown, superseded[host]))
        infos.extend(listing.ranks)
        metrics.append(figures)
    ranks = sorted((r for resp in responses for r in resp.ranks), key=lambda r: (r.job_id, r.rank))
    view = report(
        ranks=ranks,
        stragglers=rescore_stragglers(responses, threshold),
        threshold=threshold,
        verdicts=job_verdicts(ranks, infos),
        errors=errors,
    )
    return view, metrics


def bottleneck_document(view: BottleneckReport, png: Path | None) -> dict:
    return {
        "ranks": [json_documents.message_dict(r) for r in view.ranks],
        "straggler_threshold": view.threshold,
        "stragglers": [json_documents.message_dict(s) for s in view.stragglers],
        "jobs": [json_documents.dataclass_dict(v) for v in view.verdicts],
        "errors": [{"host": host, "error": error} for host, error in view.errors],
        "png": str(png) if png is not None else None,
    }


# -- plait profile -------------------------------------------------------------------------------


def profile_document(
    *,
    output: str,
    response: control_pb2.ProfileResponse,
    analysis: control_pb2.TraceAnalysis,
    outcomes: Sequence[control_pb2.RankOutcome],
    errors: Sequence[HostError],
) -> dict:
    return {
        "file": output,
        "start_step": response.start_step,
        "steps": response.steps,
        "analysis": json_documents.message_dict(analysis),
        "outcomes": [json_documents.message_dict(o) for o in outcomes],
        "errors": [{"host": host, "error": error} for host, error in errors],
    }
