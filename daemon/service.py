"""The `plait.v1.Daemon` gRPC service: translates the analysis layer's records to protobuf.

What the figures mean is decided in `plait.daemon.analysis` (plain dataclasses, no gRPC); this
module only takes the store's lock around an analysis and turns its records into `plait.v1`
messages (hang reports and straggler scores with `plait.daemon.report_messages`, which the CLI
reads too). The exporters' points come from the same analysis (`plait.daemon.points`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from plait.core.version import __version__
from plait.daemon.analysis import (
    DEFAULT_METRICS_WINDOW_STEPS,
    BottleneckView,
    ExpertLayerFigures,
    JobFigures,
    JobState,
    MetricsView,
    RankAnalysis,
    RankFigures,
    RankState,
    StalePolicy,
    bottleneck_view,
    job_states,
    metrics_view,
    visible,
)
from plait.daemon.checkpoint_log import CheckpointSaveFigures, JobCheckpointFigures
from plait.daemon.chrome_trace import chrome_trace_json
from plait.daemon.exporters import DaemonPoint
from plait.daemon.fault_tolerance_messages import fault_tolerant_job_message, lighthouse_message
from plait.daemon.forwarding import ForwarderStats
from plait.daemon.hangs import DEFAULT_HANG_TIMEOUT_SECONDS, Hang, find_hangs
from plait.daemon.host import HostCollector, HostSample
from plait.daemon.ingest_pool import PoolStats
from plait.daemon.job_questions import PROTOCOL as JOB_PROTOCOL
from plait.daemon.job_questions import JobQuestions
from plait.daemon.nvml import NvmlCollector
from plait.daemon.replica_groups import fault_tolerance_views
from plait.daemon.report_messages import hang_message, straggler_message
from plait.daemon.security import CallCounters
from plait.daemon.shared_answers import SharedAnswers
from plait.daemon.store import TelemetryStore
from plait.daemon.stragglers import DEFAULT_THRESHOLD
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc, metrics_pb2

__all__ = ["DEFAULT_METRICS_WINDOW_STEPS", "DaemonExtras", "DaemonService", "daemon_points"]

# Spans reach the daemon up to one batch delay (plus an export) after they end.
TRACE_FLUSH_SLACK_SECONDS = 1.5
MAX_TRACE_SECONDS = 600.0


# --------------------------------------------------------------------------------------------
# analysis records -> plait.v1 messages
# --------------------------------------------------------------------------------------------


def rank_info(state: RankState) -> metrics_pb2.RankInfo:
    window = state.window
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
        status=state.status,
        restart_attempt=i.restart_attempt,
        silent_seconds=state.silent_seconds,
        stale_after_seconds=state.stale_after_seconds,
        replica_group=i.replica_group,
    )


def rank_metrics(r: RankFigures) -> metrics_pb2.RankMetrics:
    return metrics_pb2.RankMetrics(
        job_id=r.job_id,
        rank=r.rank,
        host=r.host,
        step=r.step,
        window_steps=r.window_steps,
        step_seconds=r.step_seconds,
        tokens_per_second=r.tokens_per_second,
        model_flops_per_second=r.model_flops_per_second,
        peak_flops=r.peak_flops,
        mfu=r.mfu,
        data_wait_seconds=r.data_wait_seconds,
        comm_seconds=r.comm_seconds,
        comm_share=r.comm_share,
        loss=r.loss,
        cpu_percent=r.usage.cpu_percent,
        memory_rss_bytes=r.usage.memory_rss_bytes,
        device_memory_bytes=r.device_memory_bytes,
        device_utilization=r.usage.device_utilization,
        otel_metrics=r.otel_metrics,
        status=r.status,
        silent_seconds=r.silent_seconds,
        restart_attempt=r.restart_attempt,
        comm_bytes_per_step=metrics_pb2.CommBytes(
            intra_node=r.comm_bytes_intra_node, inter_node=r.comm_bytes_inter_node
        ),
        replica_group=r.replica_group,
    )


def expert_layer_load(f: ExpertLayerFigures) -> metrics_pb2.ExpertLayerLoad:
    return metrics_pb2.ExpertLayerLoad(
        layer=f.layer,
        experts=f.experts,
        step=f.step,
        tokens=f.tokens,
        max_tokens=f.max_tokens,
        mean_tokens=f.mean_tokens,
        imbalance=f.imbalance,
        dropped=f.dropped,
        dropped_fraction=f.dropped_fraction,
        mean_imbalance=f.mean_imbalance,
        steps=f.steps,
    )


def checkpoint_save(f: CheckpointSaveFigures | None) -> metrics_pb2.CheckpointSave | None:
    if f is None:
        return None
    return metrics_pb2.CheckpointSave(
        step=f.step,
        asynchronous=f.asynchronous,
        outcome=f.outcome,
        error=f.error,
        start_unix_nano=f.start_unix_nano,
        end_unix_nano=f.end_unix_nano,
        write_seconds=f.write_seconds,
        blocked_seconds=f.blocked_seconds,
        bytes=f.nbytes,
        age_seconds=f.age_seconds,
    )


def job_checkpoints(f: JobCheckpointFigures | None) -> metrics_pb2.JobCheckpoints | None:
    if f is None:
        return None
    return metrics_pb2.JobCheckpoints(
        last=checkpoint_save(f.last),
        writing=checkpoint_save(f.writing),
        saves=f.saves,
        failed=f.failed,
    )


def job_metrics(j: JobFigures) -> metrics_pb2.JobMetrics:
    return metrics_pb2.JobMetrics(
        job_id=j.job_id,
        world_size=j.world.current_size,
        ranks_reporting=j.ranks_reporting,
        step=j.step,
        window_steps=j.window_steps,
        step_seconds=j.step_seconds,
        tokens_per_second=j.tokens_per_second,
        model_flops_per_second=j.model_flops_per_second,
        peak_flops=j.peak_flops,
        mfu=j.mfu,
        state=j.state,
        restarts=j.world.restarts,
        world_sizes=j.world.sizes,
        world_started_step=j.world.started_step,
        ranks_stale=j.ranks_stale,
        expert_load=[expert_layer_load(f) for f in j.expert_load],
        world_started_unix_nano=j.world.started_ns,
        last_heard_unix_nano=j.world.last_heard_ns,
        comm_bytes_per_step=metrics_pb2.CommBytes(
            intra_node=j.comm_bytes_intra_node, inter_node=j.comm_bytes_inter_node
        ),
        checkpoints=job_checkpoints(j.checkpoints),
    )


def bottleneck_breakdown(a: RankAnalysis) -> metrics_pb2.BottleneckBreakdown:
    b = a.breakdown
    return metrics_pb2.BottleneckBreakdown(
        job_id=a.job_id,
        rank=a.rank,
        step_seconds=b.step_seconds,
        compute_seconds=b.seconds["compute"],
        exposed_comm_seconds=b.seconds["exposed_comm"],
        data_wait_seconds=b.seconds["data"],
        pipeline_bubble_seconds=b.seconds["pipeline_bubble"],
        optimizer_seconds=b.seconds["optimizer"],
        host_other_seconds=b.seconds["host_other"],
        dominant=b.dominant,
        steps=b.steps,
        advice=a.advice,
        exposed_comm_by_purpose=b.exposed_comm_by_purpose,
        comm_seconds=b.comm_seconds,
        median_step_seconds=b.median_step_seconds,
        median_compute_seconds=b.median_compute_seconds,
        comm_ops_by_purpose={
            purpose: ",".join(sorted(ops)) for purpose, ops in b.comm_ops_by_purpose.items()
        },
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
    stale_policy: StalePolicy = field(default_factory=StalePolicy)
    # The ingest workers' counters, when trace requests are decoded in worker processes.
    ingest_stats: Callable[[], PoolStats] | None = None
    # The control channel's counters: endpoints polling, requests refused, deliveries rejected.
    control_stats: Callable[[], dict[str, int]] | None = None
    # HOST:PORT of the torchft lighthouse the daemon hosts ("" when none): read by Status.
    lighthouse_address: str = ""
    # HOST:PORT of the Prometheus /metrics endpoint ("" when none): read by Status.
    prometheus_address: str = ""
    # The job questions across daemons (`AskJob`, `ListJobDaemons`), when the server wires them.
    job_questions: JobQuestions | None = None


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
        # Streams, `plait top` and scrapers ask the same questions at once: one computation each.
        self.answers: SharedAnswers[Any] = SharedAnswers()

    def hangs(self) -> list[Hang]:
        return find_hangs(
            self.store.heartbeats(),
            now_ns=time.time_ns(),
            timeout_seconds=self.extras.hang_timeout_seconds,
        )

    # -- the analysis, under the store's lock ---------------------------------------------------

    def _jobs(self, job_id: str, window_steps: int) -> list[JobState]:
        return job_states(
            self.store,
            now_ns=time.time_ns(),
            policy=self.extras.stale_policy,
            window_steps=window_steps,
            job_id=job_id,
        )

    def metrics_view(
        self,
        job_id: str = "",
        window_steps: int = DEFAULT_METRICS_WINDOW_STEPS,
        include_finished: bool = False,
    ) -> MetricsView:
        host = self.host.latest
        utilization = self.extras.nvml.utilization_by_index() if self.extras.nvml else {}
        with self.store.lock:
            jobs = visible(
                self._jobs(job_id, window_steps), include_finished=include_finished, job_id=job_id
            )
            return metrics_view(
                jobs,
                window_steps=window_steps,
                host=host,
                gpu_utilization=utilization,
                include_superseded=include_finished,
                checkpoint_logs={j.job_id: self.store.checkpoint_log(j.job_id) for j in jobs},
                now_ns=time.time_ns(),
            )

    def bottleneck_view(
        self,
        job_id: str = "",
        window_steps: int = DEFAULT_METRICS_WINDOW_STEPS,
        threshold: float = 0.0,
        include_finished: bool = False,
    ) -> BottleneckView:
        with self.store.lock:
            jobs = visible(
                self._jobs(job_id, window_steps), include_finished=include_finished, job_id=job_id
            )
            return bottleneck_view(
                jobs,
                window_steps=window_steps,
                threshold=threshold or self.extras.straggler_threshold,
            )

    # -- RPCs -----------------------------------------------------------------------------------

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
            jobs = self._jobs("", DEFAULT_METRICS_WINDOW_STEPS)
            states = {j.job_id: j.state for j in jobs}
            fault_tolerant = fault_tolerance_views(
                jobs, {j.job_id: store.quorum_log(j.job_id) for j in jobs}
            )
        extras = self.extras
        nvml = extras.nvml
        policy = extras.stale_policy
        return daemon_pb2.StatusResponse(
            version=__version__,
            hostname=self.host.hostname,
            bind_address=self.bind_address,
            uptime_seconds=time.monotonic() - self.started,
            job_ids=sorted(states),
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
            job_states=states,
            stale_floor_seconds=policy.floor_seconds,
            stale_step_multiple=policy.step_multiple,
            stale_ceiling_seconds=policy.ceiling_seconds,
            fault_tolerant_jobs=[fault_tolerant_job_message(v) for v in fault_tolerant],
            lighthouse=(
                lighthouse_message(extras.lighthouse_address) if extras.lighthouse_address else None
            ),
            protocol=JOB_PROTOCOL,
            prometheus_address=extras.prometheus_address,
            **self._ingest_status(),
            **(extras.control_stats() if extras.control_stats else {}),
        )

    def _ingest_status(self) -> dict[str, int]:
        if self.extras.ingest_stats is None:
            return {}
        stats = self.extras.ingest_stats()
        return {
            "ingest_workers": stats.workers,
            "ingest_worker_requests": stats.decoded_requests,
            "ingest_worker_restarts": stats.restarts,
        }

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
            jobs = self._jobs(request.job_id, DEFAULT_METRICS_WINDOW_STEPS)
            ranks = [rank_info(r) for job in jobs for r in job.ranks]
        return daemon_pb2.ListRanksResponse(ranks=ranks)

    def _metrics(
        self, job_id: str, window_steps: int, include_finished: bool
    ) -> daemon_pb2.GetMetricsResponse:
        key = ("metrics", job_id, window_steps, include_finished)
        return self.answers.get(
            key, lambda: self._compute_metrics(job_id, window_steps, include_finished)
        )

    def _compute_metrics(
        self, job_id: str, window_steps: int, include_finished: bool
    ) -> daemon_pb2.GetMetricsResponse:
        view = self.metrics_view(
            job_id, window_steps or DEFAULT_METRICS_WINDOW_STEPS, include_finished
        )
        return daemon_pb2.GetMetricsResponse(
            host=host_metrics(self.host.latest),
            computed_unix_nano=time.time_ns(),
            ranks=[rank_metrics(r) for r in view.ranks],
            jobs=[job_metrics(j) for j in view.jobs],
        )

    def GetMetrics(
        self, request: daemon_pb2.GetMetricsRequest, context: grpc.ServicerContext
    ) -> daemon_pb2.GetMetricsResponse:
        if request.window_steps < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "window_steps must be >= 0")
        return self._metrics(request.job_id, request.window_steps, request.include_finished)

    def StreamMetrics(
        self, request: daemon_pb2.StreamMetricsRequest, context: grpc.ServicerContext
    ) -> Iterator[daemon_pb2.GetMetricsResponse]:
        if request.window_steps < 0 or request.interval_seconds < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "negative window or interval")
        interval = max(request.interval_seconds or 1.0, 0.05)
        while context.is_active() and not self.stopping.is_set():
            yield self._metrics(request.job_id, request.window_steps, request.include_finished)
            if self.stopping.wait(interval):
                return

    def GetBottleneck(
        self, request: daemon_pb2.GetBottleneckRequest, context: grpc.ServicerContext
    ) -> daemon_pb2.GetBottleneckResponse:
        if request.window_steps < 0 or request.straggler_threshold < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "negative window or threshold")
        threshold = request.straggler_threshold or self.extras.straggler_threshold
        window_steps = request.window_steps or DEFAULT_METRICS_WINDOW_STEPS
        key = ("bottleneck", request.job_id, window_steps, threshold, request.include_finished)
        return self.answers.get(
            key,
            lambda: self._compute_bottleneck(
                request.job_id, window_steps, threshold, request.include_finished
            ),
        )

    def _compute_bottleneck(
        self, job_id: str, window_steps: int, threshold: float, include_finished: bool
    ) -> daemon_pb2.GetBottleneckResponse:
        view = self.bottleneck_view(job_id, window_steps, threshold, include_finished)
        return daemon_pb2.GetBottleneckResponse(
            ranks=[bottleneck_breakdown(a) for a in view.ranks],
            dominant=view.dominant,
            advice=view.advice,
            stragglers=[straggler_message(s) for s in view.stragglers],
            straggler_threshold=threshold,
        )

    def ListJobDaemons(
        self, request: daemon_pb2.ListJobDaemonsRequest, context: grpc.ServicerContext
    ) -> daemon_pb2.ListJobDaemonsResponse:
        return self._job_questions(context).list_daemons(request.job_id)

    def AskJob(
        self, request: daemon_pb2.AskJobRequest, context: grpc.ServicerContext
    ) -> daemon_pb2.AskJobResponse:
        if not request.job_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id: empty")
        if request.deadline_seconds < 0 or request.max_in_flight < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "negative deadline or max_in_flight")
        return self._job_questions(context).ask(request)

    def _job_questions(self, context: grpc.ServicerContext) -> JobQuestions:
        questions = self.extras.job_questions
        if questions is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon answers no job questions")
        return questions

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
    """Every figure the exporters publish (`plait.daemon.points`), computed now."""
    from plait.daemon.points import daemon_points as points

    return points(service, window_steps)
