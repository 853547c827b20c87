"""What `plait status`, `top` and `bottleneck` show: the tables built from the daemons' answers.

Each view is a list of `Column`s over a typed row, so a new figure is one more `Column`; see
`plait.tools.daemon_tables` for how a table adapts to the terminal width. A host that did not
answer is never a row: the views return its error as a line printed under the tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from plait.daemon.hangs import Hang, merge_hangs
from plait.daemon.job_reports import (
    BottleneckReport,
    ExpertRow,
    HostError,
    HostRow,
    JobSummary,
    TopReport,
)
from plait.daemon.mfu import CALIBRATION_ADVICE, format_mfu, is_calibration_error
from plait.proto.plait.v1 import control_pb2, daemon_pb2, metrics_pb2
from plait.tools.control_views import render_hang_stacks
from plait.tools.daemon_jobs import expert_columns, world_columns
from plait.tools.daemon_tables import (
    Column,
    build_table,
    format_bytes,
    is_narrow,
    milliseconds,
    percent,
    short_job_ids,
)
from plait.tools.replica_group_views import (
    lighthouses,
    merge_fault_tolerant_jobs,
    render_fault_tolerance,
)

if TYPE_CHECKING:
    pass


def error_lines(errors: Sequence[HostError]) -> list[Text]:
    """One red line per host that did not answer, for under the tables."""
    return [Text(f"{host}: {error}", style="red") for host, error in errors]


def checkpoint_texts(jobs: Sequence[JobSummary], names: Mapping[str, str]) -> list[Text]:
    """Each job's checkpoint lines ("job-a  checkpoint: step 40 saved in 1.8 s …"); a failed
    save in red."""
    return [
        Text(
            f"{names.get(job.job_id, job.job_id)}  {line}",
            style="red" if " failed after " in line else "",
        )
        for job in jobs
        for line in job.checkpoint_lines()
    ]


def _uniform(rows: Sequence[object], attribute: str) -> bool:
    return len({getattr(r, attribute) for r in rows}) <= 1


# --------------------------------------------------------------------------------------------
# plait status
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DaemonRow:
    host: str
    state: daemon_pb2.StatusResponse


def _dropped(s: daemon_pb2.StatusResponse) -> str:
    if not (s.spans_dropped or s.metric_points_dropped or s.calls_rejected):
        return "-"
    return (
        f"{s.spans_dropped} spans, {s.metric_points_dropped} points, "
        f"{s.calls_rejected} calls refused"
    )


def _rejected(s: daemon_pb2.StatusResponse) -> str:
    if not (s.spans_rejected or s.metric_points_rejected):
        return "-"
    return f"{s.spans_rejected} spans, {s.metric_points_rejected} points"


def _ingest(s: daemon_pb2.StatusResponse) -> str:
    if not s.ingest_workers:
        return "-"
    restarts = f", {s.ingest_worker_restarts} restarted" if s.ingest_worker_restarts else ""
    return f"{s.ingest_workers} workers, {s.ingest_worker_requests} requests{restarts}"


def daemon_columns(jobs: Mapping[str, str]) -> list[Column[DaemonRow]]:
    return [
        Column("host", lambda d: d.host, "left", keep_empty=True),
        Column("version", lambda d: d.state.version, wide_only=True),
        Column("uptime s", lambda d: f"{d.state.uptime_seconds:.0f}"),
        Column(
            "jobs",
            lambda d: ", ".join(jobs.get(j, j) for j in d.state.job_ids) or "-",
            "left",
            wraps=True,
        ),
        Column("ranks", lambda d: str(d.state.ranks)),
        Column("spans", lambda d: str(d.state.spans_received)),
        Column("metric points", lambda d: str(d.state.metric_points_received), wide_only=True),
        Column("dropped", lambda d: _dropped(d.state), "left", wraps=True),
        Column("rejected", lambda d: _rejected(d.state), "left", wraps=True),
        Column("ingest", lambda d: _ingest(d.state), "left", wide_only=True, wraps=True),
        Column("GPUs", lambda d: d.state.gpu_collector, "left", wide_only=True, wraps=True),
        Column(
            "exporters",
            lambda d: ", ".join(d.state.exporters) or "-",
            "left",
            wide_only=True,
            wraps=True,
        ),
    ]


def rank_label(rank: metrics_pb2.RankInfo) -> str:
    """ "3", or "g1/3" for rank 3 of replica group 1 (each group numbers its ranks from 0)."""
    if rank.replica_group >= 0:
        return f"g{rank.replica_group}/{rank.rank}"
    return str(rank.rank)


def rank_info_columns(jobs: Mapping[str, str]) -> list[Column[metrics_pb2.RankInfo]]:
    return [
        Column("job", lambda r: jobs.get(r.job_id, r.job_id), "left", keep_empty=True),
        Column("rank", rank_label, keep_empty=True),
        Column("status", lambda r: r.status or "-", "left"),
        Column("world", lambda r: str(r.world_size)),
        Column("attempt", lambda r: str(r.restart_attempt) if r.restart_attempt else "-"),
        Column("silent s", lambda r: f"{r.silent_seconds:.0f}", wide_only=True),
        # When too wide, what goes first: the mesh, the dtype and the host (priority 0).
        Column("host", lambda r: r.host, "left", priority=0),
        Column("pid", lambda r: str(r.pid), wide_only=True),
        Column("device", lambda r: r.device or "-", "left"),
        Column("device name", lambda r: r.device_name or "-", "left", wide_only=True, wraps=True),
        Column("dtype", lambda r: r.compute_dtype or "-", "left", priority=0),
        Column("peak TFLOP/s", lambda r: f"{r.peak_flops / 1e12:.3f}"),
        Column(
            "peak from", lambda r: r.peak_flops_source or "-", "left", wide_only=True, wraps=True
        ),
        Column(
            "mesh",
            lambda r: " ".join(f"{a}={c}" for a, c in sorted(r.coordinates.items())),
            "left",
            wraps=True,
            priority=0,
        ),
        Column("steps", lambda r: str(r.steps_received), priority=2),
    ]


@dataclass(frozen=True, slots=True)
class StatusView:
    daemons: list[DaemonRow]
    ranks: list[metrics_pb2.RankInfo]
    hangs: list[Hang]
    errors: list[HostError]
    jobs: list[JobSummary] = field(default_factory=list)
    experts: list[ExpertRow] = field(default_factory=list)  # one per MoE layer
    # Stacks of the ranks of hung collectives (`plait.v1.Control` RankStacks).
    hang_stacks: list[control_pb2.RankStacks] = field(default_factory=list)
    # (job, rank) -> where the rank reports ("node1 (B:7461)"), when the whole job was asked.
    rank_places: dict[tuple[str, int], str] = field(default_factory=dict)

    def render(self, width: int) -> Group:
        ids = {j for d in self.daemons for j in d.state.job_ids} | {r.job_id for r in self.ranks}
        ids |= {h.job_id for h in self.hangs}
        jobs = short_job_ids(ids, width)
        parts: list[RenderableType] = [
            build_table("daemons", daemon_columns(jobs), self.daemons, width),
            *error_lines(self.errors),
        ]
        if self.jobs:
            parts.append(build_table("jobs", job_columns(jobs), self.jobs, width))
            parts.extend(checkpoint_texts(self.jobs, jobs))
        if self.experts:
            parts.append(build_table("expert load", expert_columns(jobs), self.experts, width))
        parts.append(build_table("ranks", rank_info_columns(jobs), self.ranks, width))
        rejects = [
            (d.host, reason, count)
            for d in self.daemons
            for reason, count in sorted(d.state.rejected_by_reason.items())
        ]
        if rejects:
            table = Table(title="rejected at the door (bad attributes; not stored, not forwarded)")
            for column in ("host", "reason", "items"):
                table.add_column(column)
            for host, reason, count in rejects:
                table.add_row(Text(host), Text(reason), str(count))
            parts.append(table)
        forwarding = [d for d in self.daemons if d.state.HasField("forwarder")]
        if forwarding:
            parts.append(forwarding_table(forwarding))
        parts.extend(
            render_fault_tolerance(
                merge_fault_tolerant_jobs([d.state for d in self.daemons]),
                lighthouses([(d.host, d.state) for d in self.daemons]),
                jobs,
            )
        )
        hangs = render_hangs(self.hangs, jobs, self.rank_places)
        if hangs is not None:
            parts.append(hangs)
            if self.hang_stacks:
                parts.append(render_hang_stacks(self.hang_stacks))
        return Group(*parts)


def forwarding_table(daemons: Sequence[DaemonRow]) -> Table:
    table = Table(title="forwarding upstream")
    for column in ("host", "endpoint", "forwarded", "retries", "queued", "dropped"):
        table.add_column(column)
    for d in daemons:
        f = d.state.forwarder
        dropped = ", ".join(f"{r}: {n}" for r, n in sorted(f.dropped_by_reason.items()))
        table.add_row(
            Text(d.host),
            Text(f.endpoint),
            f"{f.forwarded_requests} requests",
            str(f.retries),
            f"{f.queued_requests} ({format_bytes(f.queued_bytes)} of "
            f"{format_bytes(f.queue_capacity_bytes)})",
            Text(
                f"{f.dropped_spans} spans, {f.dropped_metric_points} points"
                + (f" ({dropped})" if dropped else "")
            ),
        )
    return table


def render_hangs(
    reports: list[Hang],
    jobs: Mapping[str, str] | None = None,
    places: Mapping[tuple[str, int], str] | None = None,
) -> Table | None:
    """The hangs of all daemons, merged per collective (None when there are none); a missing
    rank is named with where it runs when `places` knows (a job asked as a whole)."""
    merged = merge_hangs(reports)
    if not merged:
        return None
    jobs, places = jobs or {}, places or {}
    table = Table(title="[red]collective hangs[/red]")
    for column in ("job", "group", "op", "seq", "waiting s", "entered", "missing"):
        table.add_column(column)
    for hang in merged:
        missing = [
            f"{r} on {places[(hang.job_id, r)]}" if (hang.job_id, r) in places else str(r)
            for r in hang.missing_ranks
        ]
        missing += [f"{r} (no daemon sees it)" for r in hang.unreported_ranks]
        replica_group = f" replica group {hang.replica_group}" if hang.replica_group >= 0 else ""
        table.add_row(
            Text(jobs.get(hang.job_id, hang.job_id) + replica_group),
            Text(f"{hang.group} {list(hang.group_ranks)}"),
            Text(f"{hang.op} ({hang.purpose})" if hang.purpose else hang.op),
            str(hang.seq),
            f"{hang.waiting_seconds:.1f}",
            ", ".join(map(str, hang.entered_ranks)) or "-",
            ", ".join(missing),
        )
    return table


# --------------------------------------------------------------------------------------------
# plait top
# --------------------------------------------------------------------------------------------


def job_columns(jobs: Mapping[str, str]) -> list[Column[JobSummary]]:
    return [
        Column("job", lambda j: jobs.get(j.job_id, j.job_id), "left", keep_empty=True),
        Column("ranks", lambda j: f"{j.ranks_reporting}/{j.world_size}"),
        *world_columns(),
        Column("step", lambda j: str(j.step)),
        Column("tokens/s", lambda j: f"{j.tokens_per_second:,.0f}"),
        Column("TFLOP/s", lambda j: f"{j.model_flops_per_second / 1e12:.3f}"),
        Column("MFU", lambda j: format_mfu(j.mfu)),
        Column("step ms", lambda j: milliseconds(j.step_seconds)),
    ]


def _memory(r: metrics_pb2.RankMetrics) -> str:
    return format_bytes(r.device_memory_bytes if r.device_memory_bytes >= 0 else r.memory_rss_bytes)


def rank_metric_columns(
    jobs: Mapping[str, str], rows: Sequence[metrics_pb2.RankMetrics], width: int
) -> list[Column[metrics_pb2.RankMetrics]]:
    # On a narrow terminal, host and job go when every row has the same one: the hosts and
    # jobs tables above already name it.
    narrow = is_narrow(width)
    return [
        Column("host", lambda r: r.host, "left", wide_only=narrow and _uniform(rows, "host")),
        Column(
            "job",
            lambda r: jobs.get(r.job_id, r.job_id),
            "left",
            wide_only=narrow and _uniform(rows, "job_id"),
        ),
        Column("rank", lambda r: str(r.rank), keep_empty=True),
        Column("status", lambda r: r.status if r.status != "live" else "", "left"),
        Column("step", lambda r: str(r.step)),
        Column("tokens/s", lambda r: f"{r.tokens_per_second:,.0f}"),
        Column("MFU", lambda r: format_mfu(r.mfu)),
        Column("step ms", lambda r: milliseconds(r.step_seconds)),
        Column("comm %", lambda r: percent(r.comm_share)),
        Column("data ms", lambda r: milliseconds(r.data_wait_seconds)),
        Column("memory", _memory),
        Column("CPU %", lambda r: percent(r.cpu_percent / 100) if r.cpu_percent >= 0 else "-"),
        Column("GPU %", lambda r: percent(r.device_utilization)),
    ]


def _host_memory(h: HostRow) -> str:
    used, total = h.host.memory_used_bytes, h.host.memory_total_bytes
    return "-" if total <= 0 else f"{used / 2**30:.1f} / {total / 2**30:.1f}"


def host_columns(width: int) -> list[Column[HostRow]]:
    def name(h: HostRow) -> str:
        # The address alone on a narrow terminal: it is what --host takes.
        return h.address if is_narrow(width) else f"{h.host.hostname} ({h.address})"

    return [
        Column("host", name, "left", keep_empty=True),
        Column("CPU %", lambda h: f"{h.host.cpu_percent:.0f}"),
        Column("cores", lambda h: str(h.host.cpu_count)),
        Column("memory GiB", _host_memory),
        Column("net out/s", lambda h: format_bytes(h.host.net_sent_bytes_per_second)),
        Column("net in/s", lambda h: format_bytes(h.host.net_recv_bytes_per_second)),
    ]


class TopView(TopReport):
    """`plait top`'s report, drawn for the terminal."""

    __slots__ = ()

    def render(self, width: int) -> Group:
        jobs = short_job_ids([j.job_id for j in self.jobs] + [r.job_id for r in self.ranks], width)
        parts: list[RenderableType] = [
            build_table("jobs", job_columns(jobs), self.jobs, width),
            *checkpoint_texts(self.jobs, jobs),
            build_table("ranks", rank_metric_columns(jobs, self.ranks, width), self.ranks, width),
            *(
                [build_table("expert load", expert_columns(jobs), self.experts, width)]
                if self.experts
                else []
            ),
            build_table("hosts", host_columns(width), self.hosts, width),
            *error_lines(self.errors),
        ]
        wrong_peaks = [
            f"{jobs.get(r.job_id, r.job_id)}/{r.rank}"
            for r in self.ranks
            if is_calibration_error(r.mfu)
        ]
        if wrong_peaks or any(is_calibration_error(j.mfu) for j in self.jobs):
            parts.append(
                Text.from_markup(
                    f"[red]calibration error[/red] ({escape(', '.join(wrong_peaks)) or 'job'}): "
                    + CALIBRATION_ADVICE
                )
            )
        return Group(*parts)


def render_top(
    latest: Mapping[str, daemon_pb2.GetMetricsResponse | str],
    width: int = 200,
    *,
    show_superseded: bool = False,
) -> Group:
    """The `plait top` screen for the latest response (or error text) of each host."""
    return TopView.from_latest(latest, show_superseded=show_superseded).render(width)


# --------------------------------------------------------------------------------------------
# plait bottleneck
#
# Its class labels and advice come from the daemon's bottleneck analysis, imported by the
# functions below: `plait status` and `plait top` never load it.
# --------------------------------------------------------------------------------------------

# (header, header below 120 columns, BottleneckBreakdown field), in the order the classes
# take precedence.
BOTTLENECK_FIELDS = (
    ("compute", "compute", "compute_seconds"),
    ("exposed comm", "comm", "exposed_comm_seconds"),
    ("data", "data", "data_wait_seconds"),
    ("bubble", "bubble", "pipeline_bubble_seconds"),
    ("optimizer", "optim", "optimizer_seconds"),
    ("host/other", "other", "host_other_seconds"),
)
DOMINANT_FIELDS = {
    "compute": "compute_seconds",
    "exposed_comm": "exposed_comm_seconds",
    "data": "data_wait_seconds",
    "pipeline_bubble": "pipeline_bubble_seconds",
    "optimizer": "optimizer_seconds",
    "host_other": "host_other_seconds",
}


def _class_column(
    header: str, narrow_header: str, attribute: str
) -> Column[metrics_pb2.BottleneckBreakdown]:
    def cell(r: metrics_pb2.BottleneckBreakdown) -> str:
        value = getattr(r, attribute)
        if not value:
            return "-"  # a class no rank spends time in (no pipeline: no bubble) can go
        # The rank's dominant class in bold: on a narrow terminal it is the only mark of it.
        is_dominant = DOMINANT_FIELDS.get(r.dominant) == attribute
        return f"[bold]{milliseconds(value)}[/bold]" if is_dominant else milliseconds(value)

    return Column(header, cell, narrow_header=narrow_header, markup=True)


def bottleneck_columns(
    jobs: Mapping[str, str], rows: Sequence[metrics_pb2.BottleneckBreakdown], width: int
) -> list[Column[metrics_pb2.BottleneckBreakdown]]:
    from plait.daemon.bottleneck import CLASS_LABELS

    narrow = is_narrow(width)
    return [
        Column(
            "job",
            lambda r: jobs.get(r.job_id, r.job_id),
            "left",
            wide_only=narrow and _uniform(rows, "job_id"),
        ),
        Column("rank", lambda r: str(r.rank), keep_empty=True),
        Column("steps", lambda r: str(r.steps), wide_only=True),
        Column("step ms", lambda r: milliseconds(r.step_seconds)),
        *(_class_column(*names) for names in BOTTLENECK_FIELDS),
        Column(
            "dominant",
            lambda r: CLASS_LABELS.get(r.dominant, r.dominant) or "-",
            "left",
            wide_only=True,
        ),
    ]


def straggler_columns(
    jobs: Mapping[str, str], rows: Sequence[metrics_pb2.StragglerScore], width: int
) -> list[Column[metrics_pb2.StragglerScore]]:
    narrow = is_narrow(width)
    return [
        Column("job", lambda s: jobs.get(s.job_id, s.job_id), "left", keep_empty=True),
        Column("rank", lambda s: str(s.rank), keep_empty=True),
        Column(
            "host", lambda s: s.host or "-", "left", wide_only=narrow and _uniform(rows, "host")
        ),
        Column("step ms", lambda s: milliseconds(s.median_step_seconds)),
        Column("step Δ", lambda s: f"{s.step_score:+.0%}"),
        Column("compute ms", lambda s: milliseconds(s.median_compute_seconds)),
        Column("compute Δ", lambda s: f"{s.compute_score:+.0%}"),
        Column("", lambda s: "[red]STRAGGLER[/red]" if s.flagged else "", "left", markup=True),
    ]


class BottleneckView(BottleneckReport):
    """`plait bottleneck`'s report, drawn for the terminal."""

    __slots__ = ()

    def render(self, width: int) -> Group:
        from plait.daemon.bottleneck import CLASS_LABELS

        jobs = short_job_ids([r.job_id for r in self.ranks], width)
        parts: list[RenderableType] = [
            build_table(
                "bottleneck (mean ms per step)",
                bottleneck_columns(jobs, self.ranks, width),
                self.ranks,
                width,
            ),
            *error_lines(self.errors),
        ]
        if self.stragglers:
            title = (
                f"stragglers (medians over the window; Δ against the job's median, "
                f"flagged above +{self.threshold:.0%})"
            )
            columns = straggler_columns(jobs, self.stragglers, width)
            parts.append(build_table(title, columns, self.stragglers, width))
        for verdict in self.verdicts:
            label = CLASS_LABELS.get(verdict.dominant, verdict.dominant)
            line = Text("job ")
            line.append(jobs.get(verdict.job_id, verdict.job_id))
            line.append(" — ")
            line.append(label, style="bold")
            line.append(f": {verdict.advice}")
            parts.append(line)
        return Group(*parts)
