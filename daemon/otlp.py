"""OTLP receivers: the daemon implements the OpenTelemetry collector's Trace and Metrics services.

Ranks export with the stock OTLP/gRPC exporters, so any OpenTelemetry Collector could stand in
for the daemon, and the daemon could receive from any OTLP source (spans without plait resource
attributes are counted and dropped).

Ingest is bounded: at most `capacity` spans and metric points are being stored at any moment
(`IngestLimiter`). A request that would exceed it is dropped whole, counted in the store's drop
counters (reported by `Status`), and answered with an OTLP *partial success* naming the
rejected items, so the exporter does not retry into an overloaded daemon. Accepted requests
are stored before the call returns, so a query after an export sees it. Received requests can
also be handed to a forwarder (`plait.daemon.exporters.OtlpUpstream`) as they are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from plait.core import telemetry as names
from plait.daemon.hangs import heartbeat_from_points
from plait.daemon.store import SpanRecord, TelemetryStore

DEFAULT_INGEST_CAPACITY = 200_000
HEARTBEAT_METRICS = frozenset(
    {names.METRIC_COMM_HEARTBEAT, names.METRIC_COMM_INFLIGHT, names.METRIC_COMM_ENTERED}
)
Forward = Callable[[Any], None]


class IngestLimiter:
    """Admits requests while fewer than `capacity` items are being stored."""

    def __init__(self, capacity: int = DEFAULT_INGEST_CAPACITY) -> None:
        self.capacity = capacity
        self._pending = 0
        self._lock = threading.Lock()

    def acquire(self, items: int) -> bool:
        with self._lock:
            if self._pending + items > self.capacity:
                return False
            self._pending += items
            return True

    def release(self, items: int) -> None:
        with self._lock:
            self._pending -= items


def any_value(value: AnyValue) -> Any:
    """An OTLP `AnyValue` as a Python value."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, which)


def attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs}


def metric_points(metric: Metric) -> dict[str, float]:
    """Latest value of a metric: gauges and sums as is, histograms as count, sum and mean."""
    which = metric.WhichOneof("data")
    if which in ("gauge", "sum"):
        points = getattr(metric, which).data_points
        if not points:
            return {}
        latest = max(points, key=lambda p: p.time_unix_nano)
        kind = latest.WhichOneof("value")
        return {metric.name: float(getattr(latest, kind)) if kind else 0.0}
    if which in ("histogram", "exponential_histogram", "summary"):
        points = getattr(metric, which).data_points
        if not points:
            return {}
        latest = max(points, key=lambda p: p.time_unix_nano)
        count, total = int(latest.count), float(latest.sum)
        return {
            f"{metric.name}.count": float(count),
            f"{metric.name}.sum": total,
            f"{metric.name}.mean": total / count if count else 0.0,
        }
    return {}


def gauge_points(metric: Metric) -> list[tuple[str, dict[str, Any], float]]:
    """Every data point of a gauge with its attributes (the heartbeat gauges)."""
    if metric.WhichOneof("data") != "gauge":
        return []
    out = []
    for point in metric.gauge.data_points:
        kind = point.WhichOneof("value")
        value = float(getattr(point, kind)) if kind else 0.0
        out.append((metric.name, attributes(point.attributes), value))
    return out


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """`opentelemetry.proto.collector.trace.v1.TraceService/Export` into the store."""

    def __init__(
        self,
        store: TelemetryStore,
        limiter: IngestLimiter | None = None,
        forward: Forward | None = None,
    ) -> None:
        self.store = store
        self.limiter = limiter or IngestLimiter()
        self.forward = forward

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        count = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        if not self.limiter.acquire(count):
            self.store.count_dropped(spans=count)
            response = trace_service_pb2.ExportTraceServiceResponse()
            response.partial_success.rejected_spans = count
            response.partial_success.error_message = "daemon ingest queue full; spans dropped"
            return response
        try:
            self._store(request)
        finally:
            self.limiter.release(count)
        if self.forward is not None:
            self.forward(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def _store(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            records = [
                SpanRecord.classify(
                    span.name,
                    span.start_time_unix_nano,
                    span.end_time_unix_nano,
                    attributes(span.attributes),
                    span.status.code == Status.STATUS_CODE_ERROR,
                )
                for scope_spans in resource_spans.scope_spans
                for span in scope_spans.spans
            ]
            self.store.add_spans(resource, records)


def _point_count(metric: Metric) -> int:
    which = metric.WhichOneof("data")
    return len(getattr(metric, which).data_points) if which else 0


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """`opentelemetry.proto.collector.metrics.v1.MetricsService/Export` into the store."""

    def __init__(
        self,
        store: TelemetryStore,
        limiter: IngestLimiter | None = None,
        forward: Forward | None = None,
    ) -> None:
        self.store = store
        self.limiter = limiter or IngestLimiter()
        self.forward = forward

    def Export(
        self,
        request: metrics_service_pb2.ExportMetricsServiceRequest,
        context: grpc.ServicerContext,
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        count = sum(
            _point_count(m)
            for rm in request.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
        )
        if not self.limiter.acquire(count):
            self.store.count_dropped(metric_points=count)
            response = metrics_service_pb2.ExportMetricsServiceResponse()
            response.partial_success.rejected_data_points = count
            response.partial_success.error_message = "daemon ingest queue full; points dropped"
            return response
        try:
            self._store(request)
        finally:
            self.limiter.release(count)
        if self.forward is not None:
            self.forward(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def _store(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        for resource_metrics in request.resource_metrics:
            resource = attributes(resource_metrics.resource.attributes)
            points: dict[str, float] = {}
            heartbeat_points: list[tuple[str, dict[str, Any], float]] = []
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name in HEARTBEAT_METRICS:
                        heartbeat_points.extend(gauge_points(metric))
                    else:
                        points.update(metric_points(metric))
            if points:
                self.store.add_metric_points(resource, points)
            heartbeat = heartbeat_from_points(heartbeat_points, time.time_ns())
            if heartbeat is not None:
                self.store.set_heartbeat(resource, heartbeat)


def add_receivers(
    server: grpc.Server,
    store: TelemetryStore,
    *,
    limiter: IngestLimiter | None = None,
    forward_spans: Forward | None = None,
    forward_metrics: Forward | None = None,
) -> None:
    """Register both receivers; they share one ingest limit."""
    limiter = limiter or IngestLimiter()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
        TraceReceiver(store, limiter, forward_spans), server
    )
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
        MetricsReceiver(store, limiter, forward_metrics), server
    )
