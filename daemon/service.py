"""The `plait.v1.Daemon` gRPC service: ranks, metrics and MFU, bottlenecks, hangs, traces.

Also builds the flat list of figures (`DaemonPoint`s) the OTLP and Prometheus exporters publish,
so an RPC, a scrape and an upstream export report the same numbers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from plait import __version__
from plait.core import mfu
from plait.core import telemetry_schema as schema
from plait.daemon.bottleneck import CLASSES, RankBreakdown, RankContext, advice, job_dominant
from plait.daemon.bottleneck import rank_breakdown as summarise_steps
from plait.daemon.chrome_trace import chrome_trace_json
from plait.daemon.exporters import DaemonPoint
from plait.daemon.forwarding import ForwarderStats
from plait.daemon.hangs import DEFAULT_HANG_TIMEOUT_SECONDS, Hang, find_hangs
from plait.daemon.host import HostCollector, HostSample
from plait.daemon.nvml import NvmlCollector, metric_points
from plait.daemon.security import CallCounters
from plait.daemon.store import RankWindow, TelemetryStore
from plait.daemon.stragglers import DEFAULT_THRESHOLD, RankTiming, StragglerScore, score_ranks
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc, metrics_pb2

DEFAULT_METRICS_WINDOW_STEPS = 20
# Spans reach the daemon up to one batch delay (plus an export) after they end.
TRACE_FLUSH_SLACK_SECONDS = 1.5
MAX_TRACE_SECONDS = 600.0


def rank_info(window: RankWindow) -> metrics_pb2.RankInfo:
    i = window.identity
    return metrics_pb2.RankInfo(
        job_id=i.job_id,
        rank=i.rank,
        local_rank=i.local_rank,
        world_size=i.world_size,
        host=i.host,
        pid=i.pid,
        device=i.device,
        device_name=i.device_name,
        compute_dtype=i.compute_dtype,
        peak_flops=i.peak_flops,
        peak_flops_source=i.peak_flops_source,
        model_name=i.model_name,
        num_params=i.num_params,
        coordinates=i.coordinates,
        degrees=i.degrees,
        last_seen_unix_nano=window.last_seen_ns,
        spans_received=window.spans_received,
        steps_received=window.steps_received,
    )


def device_index(device: str) -> int | None:
    """ "cuda:3" -> 3 (NVML and CUDA agree on indices with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        return int(index) if index.isdigit() else 0
    return None


def rank_metrics(
    window: RankWindow,
    window_steps: int,
    host: HostSample,
    gpu_utilization: dict[int, float] | None = None,
) -> metrics_pb2.RankMetrics:
    identity = window.identity
    steps = window.last_steps(window_steps)
    rate = mfu.rank_throughput(window.samples(window_steps), identity.peak_flops)
    comm = sum(window.comm_seconds(s.step) for s in steps) / len(steps) if steps else 0.0
    process = host.processes.get(identity.key)
    last = steps[-1] if steps else None
    index = device_index(identity.device) if identity.host == host.hostname else None
    utilization = (gpu_utilization or {}).get(index, -1.0) if index is not None else -1.0
    return metrics_pb2.RankMetrics(
        job_id=identity.job_id,
        rank=identity.rank,
        host=identity.host,
        step=last.step if last else -1,
        window_steps=rate.steps,
        step_seconds=rate.step_seconds,
        tokens_per_second=rate.tokens_per_second,
        model_flops_per_second=rate.model_flops_per_second,
        peak_flops=identity.peak_flops,
        mfu=rate.mfu,
        data_wait_seconds=sum(s.data_wait_seconds for s in steps) / len(steps) if steps else 0.0,
        comm_seconds=comm,
        comm_share=comm / rate.step_seconds if rate.step_seconds > 0 else 0.0,
        loss=last.loss if last else 0.0,
        cpu_percent=process.cpu_percent if process else -1.0,
        memory_rss_bytes=process.rss_bytes if process else -1,
        # The decoder bounds this metric, so the conversion cannot fail.
        device_memory_bytes=int(window.metrics.get(schema.METRIC_DEVICE_MEMORY_USED, -1)),
        device_utilization=utilization,
        otel_metrics=window.metrics,
    )


def job_metrics(windows: list[RankWindow], window_steps: int) -> metrics_pb2.JobMetrics:
    rate = mfu.job_throughput(
        {w.identity.rank: w.samples(window_steps) for w in windows},
        {w.identity.rank: w.identity.peak_flops for w in windows},
        window_steps=window_steps,
    )
    return metrics_pb2.JobMetrics(
        job_id=windows[0].identity.job_id,
        world_size=windows[0].identity.world_size,
        ranks_reporting=len(windows),
        step=max((w.last_steps(1)[0].step for w in windows if w.steps), default=-1),
        window_steps=rate.steps,
        step_seconds=rate.step_seconds,
        tokens_per_second=rate.tokens_per_second,
        model_flops_per_second=rate.model_flops_per_second,
        peak_flops=rate.peak_flops,
        mfu=rate.mfu,
    )


def host_metrics(sample: HostSample) -> metrics_pb2.HostMetrics:
    return metrics_pb2.HostMetrics(
        hostname=sample.hostname,
        cpu_percent=sample.cpu_percent,
        cpu_count=sample.cpu_count,
        memory_used_bytes=sample.memory_used_bytes,
        memory_total_bytes=sample.memory_total_bytes,
        net_bytes_sent=sample.net_bytes_sent,
        net_bytes_recv=sample.net_bytes_recv,
        net_sent_bytes_per_second=sample.net_sent_bytes_per_second,
        net_recv_bytes_per_second=sample.net_recv_bytes_per_second,
        sampled_unix_nano=sample.sampled_ns,
    )


@dataclass(frozen=True, slots=True)
class RankAnalysis:
    """One rank's bottleneck breakdown over a window, with what advice and scoring need."""

    window_identity: tuple[str, int, str]  # job, rank, host
    breakdown: RankBreakdown
    context: RankContext


def analyse(windows: list[RankWindow], window_steps: int) -> list[RankAnalysis]:
    """Breakdowns of `windows`; call with the store's lock held."""
    return [
        RankAnalysis(
            window_identity=(w.identity.job_id, w.identity.rank, w.identity.host),
            breakdown=summarise_steps(w.breakdowns(window_steps)),
            context=RankContext(
                degrees=w.identity.degrees, comm_bytes_by_purpose=w.comm_volume(window_steps)
            ),
        )
        for w in windows
    ]


def straggler_scores(analyses: list[RankAnalysis], threshold: float) -> list[StragglerScore]:
    return score_ranks(
        (
            RankTiming(
                job_id=a.window_identity[0],
                rank=a.window_identity[1],
                host=a.window_identity[2],
                steps=a.breakdown.steps,
                median_step_seconds=a.breakdown.median_step_seconds,
                median_compute_seconds=a.breakdown.median_compute_seconds,
            )
            for a in analyses
        ),
        threshold,
    )


def straggler_message(score: StragglerScore) -> metrics_pb2.StragglerScore:
    t = score.timing
    return metrics_pb2.StragglerScore(
        job_id=t.job_id,
        rank=t.rank,
        host=t.host,
        steps=t.steps,
        median_step_seconds=t.median_step_seconds,
        median_compute_seconds=t.median_compute_seconds,
        step_score=score.step_score,
        compute_score=score.compute_score,
        flagged=score.flagged,
    )


def hang_message(hang: Hang, hostname: str) -> metrics_pb2.CollectiveHang:
    return metrics_pb2.CollectiveHang(
        job_id=hang.job_id,
        group=hang.group,
        group_ranks=hang.group_ranks,
        op=hang.op,
        seq=hang.seq,
        purpose=hang.purpose,
        entered_ranks=hang.entered_ranks,
        missing_ranks=hang.missing_ranks,
        unreported_ranks=hang.unreported_ranks,
        entered_unix_nano=hang.entered_ns,
        waiting_seconds=hang.waiting_seconds,
        host=hostname,
    )


def hang_from_message(message: metrics_pb2.CollectiveHang) -> Hang:
    return Hang(
        job_id=message.job_id,
        group=message.group,
        group_ranks=tuple(message.group_ranks),
        op=message.op,
        seq=message.seq,
        purpose=message.purpose,
        entered_ranks=tuple(message.entered_ranks),
        missing_ranks=tuple(message.missing_ranks),
        unreported_ranks=tuple(message.unreported_ranks),
        entered_ns=message.entered_unix_nano,
        waiting_seconds=message.waiting_seconds,
    )


def rescore_stragglers(
    responses: Sequence[daemon_pb2.GetBottleneckResponse], threshold: float
) -> list[metrics_pb2.StragglerScore]:
    """Score every host's ranks against the medians of all hosts' ranks (one job, one scale)."""
    timings = [
        RankTiming(
            job_id=s.job_id,
            rank=s.rank,
            host=s.host,
            steps=s.steps,
            median_step_seconds=s.median_step_seconds,
            median_compute_seconds=s.median_compute_seconds,
        )
        for response in responses
        for s in response.stragglers
    ]
    return [straggler_message(score) for score in score_ranks(timings, threshold)]


def job_advice(ranks: Sequence[metrics_pb2.BottleneckBreakdown]) -> tuple[str, str]:
    """(dominant class, advice) for ranks gathered from any number of daemons."""
    breakdowns = [
        RankBreakdown(
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
        )
        for r in ranks
    ]
    overall = job_dominant(breakdowns)
    return (overall.dominant, advice(overall)) if overall.steps else ("", "")


@dataclass
class DaemonExtras:
    """Optional parts the server wires in: GPUs, refused-call counters, exporter names."""

    nvml: NvmlCollector | None = None
    counters: CallCounters = field(default_factory=CallCounters)
    exporters: list[str] = field(default_factory=list)
    ingest_capacity: int = 0
    hang_timeout_seconds: float = DEFAULT_HANG_TIMEOUT_SECONDS
    straggler_threshold: float = DEFAULT_THRESHOLD
    # The upstream forwarder's counters and endpoint, when the daemon forwards.
    forwarder_stats: Callable[[], ForwarderStats] | None = None
    forwarder_endpoint: str = ""


class DaemonService(daemon_pb2_grpc.DaemonServicer):
    """Answers `plait.v1.Daemon` from the store and the host collector."""

    def __init__(
        self,
        store: TelemetryStore,
        host: HostCollector,
        *,
        bind_address: str,
        stopping: threading.Event,
        extras: DaemonExtras | None = None,
    ) -> None:
        self.store = store
        self.host = host
        self.bind_address = bind_address
        self.started = time.monotonic()
        self.stopping = stopping
        self.extras = extras or DaemonExtras()

    def hangs(self) -> list[Hang]:
        return find_hangs(
            self.store.heartbeats(),
            now_ns=time.time_ns(),
            timeout_seconds=self.extras.hang_timeout_seconds,
        )

    def Status(
        self, request: daemon_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> daemon_pb2.StatusResponse:
        store = self.store
        with store.lock:
            ranks = len(store.windows())
            counters = (store.spans_received, store.metric_points_received, store.spans_ignored)
            drops = (store.spans_dropped, store.metric_points_dropped)
            rejected = store.rejected
            rejects = (rejected.spans, rejected.metric_points, dict(rejected.by_reason))
        extras = self.extras
        nvml = extras.nvml
        return daemon_pb2.StatusResponse(
            version=__version__,
            hostname=self.host.hostname,
            bind_address=self.bind_address,
            uptime_seconds=time.monotonic() - self.started,
            job_ids=store.job_ids(),
            ranks=ranks,
            spans_received=counters[0],
            metric_points_received=counters[1],
            spans_ignored=counters[2],
            window_steps=store.window_steps,
            window_spans=store.window_spans,
            ingest_queue_capacity=extras.ingest_capacity,
            spans_dropped=drops[0],
            metric_points_dropped=drops[1],
            calls_rejected=extras.counters.total,
            hangs=[hang_message(h, self.host.hostname) for h in self.hangs()],
            hang_timeout_seconds=extras.hang_timeout_seconds,
            gpu_collector=nvml.status if nvml is not None else "no GPU collector",
            exporters=extras.exporters,
            spans_rejected=rejects[0],
            metric_points_rejected=rejects[1],
            rejected_by_reason=rejects[2],
            calls_rejected_by_reason=extras.counters.by_reason(),
            forwarder=self.forwarder_status(),
        )

    def forwarder_status(self) -> daemon_pb2.ForwarderStatus | None:
        extras = self.extras
        if extras.forwarder_stats is None:
            return None
        stats = extras.forwarder_stats()
        return daemon_pb2.ForwarderStatus(
            endpoint=extras.forwarder_endpoint,
            queued_requests=stats.queued_requests,
            queued_bytes=stats.queued_bytes,
            queue_capacity_bytes=stats.capacity_bytes,
            forwarded_requests=stats.forwarded_requests,
            retries=stats.retries,
            dropped_requests=stats.dropped_requests,
            dropped_spans=stats.dropped_spans,
            dropped_metric_points=stats.dropped_metric_points,
            dropped_by_reason=stats.dropped_by_reason,
            rejected_upstream_items=stats.rejected_upstream_items,
        )

    def ListRanks(
        self, request: daemon_pb2.ListRanksRequest, context: grpc.ServicerContext
    ) -> daemon_pb2.ListRanksResponse:
        with self.store.lock:
            ranks = [rank_info(w) for w in self.store.windows(request.job_id)]
        return daemon_pb2.ListRanksResponse(ranks=ranks)

    def _metrics(self, job_id: str, window_steps: int) -> daemon_pb2.GetMetricsResponse:
        window_steps = window_steps or DEFAULT_METRICS_WINDOW_STEPS
        host = self.host.latest
        response = daemon_pb2.GetMetricsResponse(
            host=host_metrics(host), computed_unix_nano=time.time_ns()
        )
        with self.store.lock:
            windows = self.store.windows(job_id)
            utilization = self.extras.nvml.utilization_by_index() if self.extras.nvml else {}
            response.ranks.extend(rank_metrics(w, window_steps, host, utilization) for w in windows)
            by_job: dict[str, list[RankWindow]] = {}
            for window in windows:
                by_job.setdefault(window.identity.job_id, []).append(window)
            response.jobs.extend(job_metrics(ws, window_steps) for ws in by_job.values())
        return response

    def GetMetrics(
        self, request: daemon_pb2.GetMetricsRequest, context: grpc.ServicerContext
    ) -> daemon_pb2.GetMetricsResponse:
        if request.window_steps < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "window_steps must be >= 0")
        return self._metrics(request.job_id, request.window_steps)

    def StreamMetrics(
        self, request: daemon_pb2.StreamMetricsRequest, context: grpc.ServicerContext
    ) -> Iterator[daemon_pb2.GetMetricsResponse]:
        if request.window_steps < 0 or request.interval_seconds < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "negative window or interval")
        interval = max(request.interval_seconds or 1.0, 0.05)
        while context.is_active() and not self.stopping.is_set():
            yield self._metrics(request.job_id, request.window_steps)
            if self.stopping.wait(interval):
                return

    def GetBottleneck(
        self, request: daemon_pb2.GetBottleneckRequest, context: grpc.ServicerContext
    ) -> daemon_pb2.GetBottleneckResponse:
        if request.window_steps < 0 or request.straggler_threshold < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "negative window or threshold")
        window_steps = request.window_steps or DEFAULT_METRICS_WINDOW_STEPS
        threshold = request.straggler_threshold or self.extras.straggler_threshold
        with self.store.lock:
            analyses = analyse(self.store.windows(request.job_id), window_steps)
        response = daemon_pb2.GetBottleneckResponse(straggler_threshold=threshold)
        for analysis in analyses:
            b = analysis.breakdown
            job_id, rank, _ = analysis.window_identity
            response.ranks.append(
                metrics_pb2.BottleneckBreakdown(
                    job_id=job_id,
                    rank=rank,
                    step_seconds=b.step_seconds,
                    compute_seconds=b.seconds["compute"],
                    exposed_comm_seconds=b.seconds["exposed_comm"],
                    data_wait_seconds=b.seconds["data"],
                    pipeline_bubble_seconds=b.seconds["pipeline_bubble"],
                    optimizer_seconds=b.seconds["optimizer"],
                    host_other_seconds=b.seconds["host_other"],
                    dominant=b.dominant,
                    steps=b.steps,
                    advice=advice(b, analysis.context) if b.steps else "",
                    exposed_comm_by_purpose=b.exposed_comm_by_purpose,
                    comm_seconds=b.comm_seconds,
                    median_step_seconds=b.median_step_seconds,
                    median_compute_seconds=b.median_compute_seconds,
                )
            )
        overall = job_dominant(a.breakdown for a in analyses)
        if overall.steps:
            context_degrees = analyses[0].context if analyses else RankContext()
            response.dominant = overall.dominant
            response.advice = advice(overall, context_degrees)
        response.stragglers.extend(
            straggler_message(s) for s in straggler_scores(analyses, threshold)
        )
        return response

    def CaptureTrace(
        self, request: daemon_pb2.CaptureTraceRequest, context: grpc.ServicerContext
    ) -> daemon_pb2.CaptureTraceResponse:
        if not 0 <= request.seconds <= MAX_TRACE_SECONDS:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"seconds must be between 0 and {MAX_TRACE_SECONDS:.0f}, got {request.seconds}",
            )
        if request.seconds == 0:
            start_ns, end_ns = 0, None
        else:
            start_ns = time.time_ns()
            end_ns = start_ns + int(request.seconds * 1e9)
            if self.stopping.wait(request.seconds + TRACE_FLUSH_SLACK_SECONDS):
                context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")
        spans = self.store.spans_in(
            job_id=request.job_id, ranks=request.ranks, start_ns=start_ns, end_ns=end_ns
        )
        return daemon_pb2.CaptureTraceResponse(
            chrome_trace_json=chrome_trace_json(spans),
            span_count=len(spans),
            ranks=sorted({identity.rank for identity, _ in spans}),
        )


def daemon_points(
    service: DaemonService, window_steps: int = DEFAULT_METRICS_WINDOW_STEPS
) -> list[DaemonPoint]:
    """Every figure the exporters publish, computed now."""
    points: list[DaemonPoint] = []
    nvml = service.extras.nvml
    if nvml is not None:
        counters = {"hw.energy", "hw.errors"}
        points.extend(
            DaemonPoint(name, value, attrs, counter=name in counters)
            for name, value, attrs in metric_points(nvml.latest)
        )
    metrics = service._metrics("", window_steps)
    for r in metrics.ranks:
        attrs = {schema.RESOURCE_JOB_ID: r.job_id, schema.RESOURCE_RANK: r.rank,
                 schema.RESOURCE_HOST_NAME: r.host}  # fmt: skip
        if not mfu.is_calibration_error(r.mfu):  # a wrong peak publishes no MFU at all
            points.append(DaemonPoint("plait.rank.mfu", r.mfu, attrs))
        points.append(DaemonPoint("plait.rank.step.duration", r.step_seconds, attrs))
        points.append(DaemonPoint("plait.rank.tokens_per_second", r.tokens_per_second, attrs))
    for j in metrics.jobs:
        attrs = {schema.RESOURCE_JOB_ID: j.job_id}
        if not mfu.is_calibration_error(j.mfu):
            points.append(DaemonPoint("plait.job.mfu", j.mfu, attrs))
        points.append(DaemonPoint("plait.job.tokens_per_second", j.tokens_per_second, attrs))
        points.append(DaemonPoint("plait.job.step.duration", j.step_seconds, attrs))
    with service.store.lock:
        analyses = analyse(service.store.windows(), window_steps)
        counts = (
            service.store.spans_received,
            service.store.spans_dropped,
            service.store.metric_points_dropped,
        )
        rejects = (service.store.rejected.spans, service.store.rejected.metric_points)
    for a in analyses:
        job_id, rank, host = a.window_identity
        attrs = {schema.RESOURCE_JOB_ID: job_id, schema.RESOURCE_RANK: rank,
                 schema.RESOURCE_HOST_NAME: host}  # fmt: skip
        for name in CLASSES:
            points.append(
                DaemonPoint(
                    "plait.rank.bottleneck.seconds",
                    a.breakdown.seconds[name],
                    {**attrs, "plait.bottleneck.class": name},
                )
            )
    for score in straggler_scores(analyses, service.extras.straggler_threshold):
        t = score.timing
        attrs = {schema.RESOURCE_JOB_ID: t.job_id, schema.RESOURCE_RANK: t.rank,
                 schema.RESOURCE_HOST_NAME: t.host}  # fmt: skip
        points.append(DaemonPoint("plait.rank.straggler.score", score.score, attrs))
    points.append(DaemonPoint("plait.collective.hangs", float(len(service.hangs()))))
    points.append(DaemonPoint("plait.daemon.spans.received", counts[0], counter=True))
    forwarder = service.extras.forwarder_stats() if service.extras.forwarder_stats else None
    forward_spans = forwarder.dropped_spans if forwarder else 0
    forward_points = forwarder.dropped_metric_points if forwarder else 0
    points.append(
        DaemonPoint("plait.daemon.spans.dropped", counts[1] + forward_spans, counter=True)
    )
    points.append(
        DaemonPoint("plait.daemon.metric_points.dropped", counts[2] + forward_points, counter=True)
    )
    # Rejects by reason; the totals are the sums over `reason`.
    points.append(DaemonPoint("plait.daemon.spans.rejected", rejects[0], counter=True))
    points.append(DaemonPoint("plait.daemon.metric_points.rejected", rejects[1], counter=True))
    if forwarder is not None:
        for reason, count in sorted(forwarder.dropped_by_reason.items()):
            points.append(
                DaemonPoint("plait.daemon.forward.dropped", count, {"reason": reason}, True)
            )
        points.append(DaemonPoint("plait.daemon.forward.queued", forwarder.queued_bytes))
    points.append(
        DaemonPoint("plait.daemon.calls.rejected", service.extras.counters.total, counter=True)
    )
    return points
