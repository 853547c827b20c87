"""The `plait.v1.Daemon` gRPC service: ranks, rolling-window metrics and MFU, trace capture."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc

from plait import __version__
from plait.daemon import mfu
from plait.daemon.chrome_trace import chrome_trace_json
from plait.daemon.host import HostCollector, HostSample
from plait.daemon.store import RankWindow, TelemetryStore
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


def rank_metrics(
    window: RankWindow, window_steps: int, host: HostSample
) -> metrics_pb2.RankMetrics:
    identity = window.identity
    steps = window.last_steps(window_steps)
    rate = mfu.rank_throughput(window.samples(window_steps), identity.peak_flops)
    comm = sum(window.comm_seconds(s.step) for s in steps) / len(steps) if steps else 0.0
    process = host.processes.get(identity.key)
    last = steps[-1] if steps else None
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
        device_memory_bytes=int(window.metrics.get("plait.device.memory.used", -1)),
        device_utilization=-1.0,
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


class DaemonService(daemon_pb2_grpc.DaemonServicer):
    """Answers `plait.v1.Daemon` from the store and the host collector."""

    def __init__(
        self,
        store: TelemetryStore,
        host: HostCollector,
        *,
        bind_address: str,
        stopping: threading.Event,
    ) -> None:
        self.store = store
        self.host = host
        self.bind_address = bind_address
        self.started = time.monotonic()
        self.stopping = stopping

    def Status(
        self, request: daemon_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> daemon_pb2.StatusResponse:
        store = self.store
        with store.lock:
            ranks = len(store.windows())
            counters = (store.spans_received, store.metric_points_received, store.spans_ignored)
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
            response.ranks.extend(rank_metrics(w, window_steps, host) for w in windows)
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
        context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "bottleneck analysis is not available in this daemon version",
        )
        raise AssertionError("unreachable")  # abort raises

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
