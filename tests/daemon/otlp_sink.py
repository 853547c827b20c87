"""A tiny OTLP/gRPC receiver for tests: records every request and its metadata."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from plait.daemon.otlp_requests import attributes


class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer,
               metrics_service_pb2_grpc.MetricsServiceServicer):  # fmt: skip
    """Stands in for an OpenTelemetry Collector upstream of the daemon."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Any]] = []  # (resource attributes, Span)
        self.metrics: list[tuple[dict[str, Any], Any]] = []  # (resource attributes, Metric)
        self.metadata: list[dict[str, str]] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        with self.lock:
            self.metadata.append(dict(context.invocation_metadata()))
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                for rs in request.resource_spans:
                    resource = attributes(rs.resource.attributes)
                    self.spans.extend((resource, s) for ss in rs.scope_spans for s in ss.spans)
                return trace_service_pb2.ExportTraceServiceResponse()
            for rm in request.resource_metrics:
                resource = attributes(rm.resource.attributes)
                self.metrics.extend((resource, m) for sm in rm.scope_metrics for m in sm.metrics)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    def wait_for(self, predicate: Callable[[OtlpSink], bool], timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate(self):
                    return True
            time.sleep(0.05)
        return False

    def __enter__(self) -> OtlpSink:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0.5).wait()
