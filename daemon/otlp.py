"""OTLP receivers: the daemon implements the OpenTelemetry collector's Trace and Metrics services.

Ranks export with the stock OTLP/gRPC exporters, so any OpenTelemetry Collector could stand in
for the daemon, and the daemon could receive from any OTLP source (spans without plait resource
attributes are counted as ignored and only forwarded).

Trace requests are read straight from their bytes (`plait.daemon.otlp_requests`: the wire
reader, protobuf when that reader declines), without building message objects per span; every
resource and span of a rank then goes through `plait.daemon.decoder`. One that fails is
rejected *alone*: the rest of the request is stored, the response is an OTLP partial success
whose `error_message` names the first bad attribute, the reject is counted per reason, and the
request forwarded upstream leaves the rejected items out.

Ingest is bounded: at most `capacity` spans and metric points are being stored at any moment
(`IngestLimiter`). A request that would exceed it is dropped whole, counted in the store's drop
counters (reported by `Status`), and answered with an OTLP *partial success* naming the
rejected items, so the exporter does not retry into an overloaded daemon. Accepted requests
are stored before the call returns, so a query after an export sees it. Received requests can
also be handed to a forwarder (`plait.daemon.exporters.OtlpUpstream`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric

from plait.daemon import telemetry_schema as names
from plait.daemon.decoder import (
    GaugePoint,
    Rejected,
    StaticsCache,
    check_metric_value,
    decode_heartbeat_point,
    decode_resource,
)
from plait.daemon.hangs import heartbeat_from_points
from plait.daemon.ingest import decode_resources
from plait.daemon.ingest_pool import IngestPool, WorkerLost
from plait.daemon.interpreter import collect_garbage_less_often
from plait.daemon.otlp_requests import TraceRequest, attributes, trace_request_parser
from plait.daemon.security import CallCounters
from plait.daemon.store import TelemetryStore

DEFAULT_INGEST_CAPACITY = 200_000
TRACE_SERVICE = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name
HEARTBEAT_METRICS = frozenset(
    {names.METRIC_COMM_HEARTBEAT, names.METRIC_COMM_INFLIGHT, names.METRIC_COMM_ENTERED}
)
Forward = Callable[[Any], None]
log = logging.getLogger(__name__)


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


def heartbeat_points(metric: Metric) -> list[GaugePoint]:
    """Every data point of a heartbeat gauge, decoded (`Rejected` if one is bad)."""
    if metric.WhichOneof("data") != "gauge":
        return []
    out = []
    for point in metric.gauge.data_points:
        kind = point.WhichOneof("value")
        value = float(getattr(point, kind)) if kind else 0.0
        out.append(decode_heartbeat_point(metric.name, attributes(point.attributes), value))
    return out


@dataclass
class Outcome:
    """What storing one request gave: items rejected, the first reason, and what to forward."""

    rejected: int = 0
    message: str = ""
    # Indices of rejected resources, and of rejected spans per resource, to leave out upstream.
    dropped_resources: set[int] = field(default_factory=set)
    dropped_items: dict[int, set[tuple[int, int]]] = field(default_factory=dict)

    def reject(self, error: Rejected, count: int) -> None:
        self.rejected += count
        if not self.message:
            self.message = f"rejected by the plait daemon: {error}"

    @property
    def clean(self) -> bool:
        return self.rejected == 0


class TraceReceiver:
    """`opentelemetry.proto.collector.trace.v1.TraceService/Export` into the store.

    Requests arrive as `TraceRequest`s (`trace_request_parser`), or as messages when called
    directly; either way every resource and span goes through the decoder."""

    def __init__(
        self,
        store: TelemetryStore,
        limiter: IngestLimiter | None = None,
        forward: Forward | None = None,
        *,
        pool: IngestPool | None = None,
        counters: CallCounters | None = None,
    ) -> None:
        self.store = store
        self.limiter = limiter or IngestLimiter()
        self.forward = forward
        self.statics = StaticsCache()
        self.pool = pool
        self.counters = counters or CallCounters()
        # Requests a worker could not decode are parsed here, one at a time.
        self._fallback = trace_request_parser()
        self._fallback_lock = threading.Lock()

    def Export(
        self,
        request: TraceRequest | trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        if not isinstance(request, TraceRequest):
            request = TraceRequest.from_message(request)
        if request.deferred:
            request = self._decode_deferred(request.raw, context)
        count = request.span_count
        if not self.limiter.acquire(count):
            self.store.count_dropped(spans=count)
            response = trace_service_pb2.ExportTraceServiceResponse()
            response.partial_success.rejected_spans = count
            response.partial_success.error_message = "daemon ingest queue full; spans dropped"
            return response
        try:
            outcome = self._store(request)
        finally:
            self.limiter.release(count)
        if self.forward is not None:
            message = request.message
            self.forward(message if outcome.clean else _without(message, outcome, "resource_spans"))
        response = trace_service_pb2.ExportTraceServiceResponse()
        if not outcome.clean:
            response.partial_success.rejected_spans = outcome.rejected
            response.partial_success.error_message = outcome.message
        return response

    def _decode_deferred(self, raw: bytes, context: grpc.ServicerContext) -> TraceRequest:
        """A deferred request decoded by an ingest worker, or here if the worker died on it;
        malformed bytes are answered as the call guard answers them."""
        try:
            if self.pool is not None:
                try:
                    return TraceRequest([], raw=raw, decoded=self.pool.decode(raw))
                except WorkerLost as lost:
                    log.warning("%s; decoding the request in the daemon", lost)
            with self._fallback_lock:
                return self._fallback(raw)
        except DecodeError as exc:
            self.counters.count("malformed")
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: DecodeError: {exc}"
            )
            raise  # abort raises; this line is never reached

    def _store(self, request: TraceRequest) -> Outcome:
        decoded = request.decoded
        if decoded is None:
            decoded = decode_resources(request.resources, self.statics)
        outcome = Outcome()
        for resource in decoded:
            if resource.rejected is not None:
                self.store.count_rejected(resource.rejected, spans=resource.span_count)
                outcome.reject(resource.rejected, resource.span_count)
                outcome.dropped_resources.add(resource.index)
                continue
            if resource.identity is None:
                self.store.count_ignored(resource.span_count)
                continue
            for reject in resource.span_rejects:
                self.store.count_rejected(reject.error, spans=1)
                outcome.reject(reject.error, 1)
                outcome.dropped_items.setdefault(resource.index, set()).add(
                    (reject.scope_index, reject.span_index)
                )
            self.store.add_spans(resource.identity, resource.records)
        return outcome


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
            outcome = self._store(request)
        finally:
            self.limiter.release(count)
        if self.forward is not None:
            self.forward(
                request if outcome.clean else _without(request, outcome, "resource_metrics")
            )
        response = metrics_service_pb2.ExportMetricsServiceResponse()
        if not outcome.clean:
            response.partial_success.rejected_data_points = outcome.rejected
            response.partial_success.error_message = outcome.message
        return response

    def _store(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> Outcome:
        outcome = Outcome()
        for r, resource_metrics in enumerate(request.resource_metrics):
            metrics = [
                (s, i, metric)
                for s, scope_metrics in enumerate(resource_metrics.scope_metrics)
                for i, metric in enumerate(scope_metrics.metrics)
            ]
            try:
                identity = decode_resource(attributes(resource_metrics.resource.attributes))
            except Rejected as error:
                count = sum(_point_count(m) for _, _, m in metrics)
                self.store.count_rejected(error, metric_points=count)
                outcome.reject(error, count)
                outcome.dropped_resources.add(r)
                continue
            if identity is None:
                continue
            points: dict[str, float] = {}
            heartbeat: list[GaugePoint] = []
            for s, i, metric in metrics:
                # A metric is decoded whole, then kept or rejected whole.
                try:
                    if metric.name in HEARTBEAT_METRICS:
                        heartbeat.extend(heartbeat_points(metric))
                    else:
                        values = metric_points(metric)
                        for name, value in values.items():
                            check_metric_value(name, value)
                        points.update(values)
                except Rejected as error:
                    count = _point_count(metric)
                    self.store.count_rejected(error, metric_points=count)
                    outcome.reject(error, count)
                    outcome.dropped_items.setdefault(r, set()).add((s, i))
            if points:
                self.store.add_metric_points(identity, points)
            beat = heartbeat_from_points(heartbeat, time.time_ns())
            if beat is not None:
                self.store.set_heartbeat(identity, beat)
        return outcome


def _without(request: Any, outcome: Outcome, field_name: str) -> Any:
    """A copy of `request` without the items `outcome` rejected (what may go upstream)."""
    kept = type(request)()
    items_field = "spans" if field_name == "resource_spans" else "metrics"
    scopes_field = "scope_spans" if field_name == "resource_spans" else "scope_metrics"
    for r, resource in enumerate(getattr(request, field_name)):
        if r in outcome.dropped_resources:
            continue
        dropped = outcome.dropped_items.get(r)
        if not dropped:
            getattr(kept, field_name).append(resource)
            continue
        copy = getattr(kept, field_name).add()
        copy.resource.CopyFrom(resource.resource)
        copy.schema_url = resource.schema_url
        for s, scope in enumerate(getattr(resource, scopes_field)):
            scope_copy = getattr(copy, scopes_field).add()
            scope_copy.scope.CopyFrom(scope.scope)
            scope_copy.schema_url = scope.schema_url
            getattr(scope_copy, items_field).extend(
                item for i, item in enumerate(getattr(scope, items_field)) if (s, i) not in dropped
            )
    return kept


def add_receivers(
    server: grpc.Server,
    store: TelemetryStore,
    *,
    limiter: IngestLimiter | None = None,
    forward_spans: Forward | None = None,
    forward_metrics: Forward | None = None,
    pool: IngestPool | None = None,
    counters: CallCounters | None = None,
) -> None:
    """Register both receivers; they share one ingest limit. With a `pool`, large trace
    requests are decoded in its worker processes."""
    collect_garbage_less_often()
    limiter = limiter or IngestLimiter()
    receiver = TraceReceiver(store, limiter, forward_spans, pool=pool, counters=counters)
    # Registered by hand, not with the generated helper, to receive the request's bytes.
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                TRACE_SERVICE,
                {
                    "Export": grpc.unary_unary_rpc_method_handler(
                        receiver.Export,
                        request_deserializer=trace_request_parser(
                            defer=pool.takes if pool else None
                        ),
                        response_serializer=(
                            trace_service_pb2.ExportTraceServiceResponse.SerializeToString
                        ),
                    )
                },
            ),
        )
    )
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
        MetricsReceiver(store, limiter, forward_metrics), server
    )
