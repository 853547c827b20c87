"""OTLP receivers: the daemon implements the OpenTelemetry collector's Trace and Metrics services.

Ranks export with the stock OTLP/gRPC exporters, so any OpenTelemetry Collector could stand in
for the daemon, and the daemon could receive from any OTLP source (spans without plait resource
attributes are counted and dropped).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from plait.daemon.store import SpanRecord, TelemetryStore


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


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """`opentelemetry.proto.collector.trace.v1.TraceService/Export` into the store."""

    def __init__(self, store: TelemetryStore) -> None:
        self.store = store

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
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
        return trace_service_pb2.ExportTraceServiceResponse()


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """`opentelemetry.proto.collector.metrics.v1.MetricsService/Export` into the store."""

    def __init__(self, store: TelemetryStore) -> None:
        self.store = store

    def Export(
        self,
        request: metrics_service_pb2.ExportMetricsServiceRequest,
        context: grpc.ServicerContext,
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        for resource_metrics in request.resource_metrics:
            resource = attributes(resource_metrics.resource.attributes)
            points: dict[str, float] = {}
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    points.update(metric_points(metric))
            self.store.add_metric_points(resource, points)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def add_receivers(server: grpc.Server, store: TelemetryStore) -> None:
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceReceiver(store), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsReceiver(store), server)
