"""The daemon server: health, reflection, graceful shutdown, streaming and error statuses."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from tests.daemon.daemon_fakes import FakeBackend, run_fake_rank

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_and_reflection(daemon_server: DaemonServer) -> None:
    with grpc.insecure_channel(daemon_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in (
            "",
            "plait.v1.Daemon",
            "opentelemetry.proto.collector.trace.v1.TraceService",
        ):
            response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == SERVING, service
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {
        "plait.v1.Daemon",
        "opentelemetry.proto.collector.trace.v1.TraceService",
        "opentelemetry.proto.collector.metrics.v1.MetricsService",
        "grpc.health.v1.Health",
    } <= services


def test_shutdown_reports_not_serving_before_stopping() -> None:
    server = DaemonServer("127.0.0.1:0", host_interval=0.2).start()
    seen_at_stop: list[int] = []
    original_stop = server.server.stop

    def recording_stop(grace: float | None) -> threading.Event:
        # what a load balancer's health probe would see at the moment the server stops
        request = health_pb2.HealthCheckRequest(service="")
        seen_at_stop.append(server.health.Check(request, None).status)
        return original_stop(grace)

    server.server.stop = recording_stop  # type: ignore[method-assign]
    channel = grpc.insecure_channel(server.address)
    stream = daemon_pb2_grpc.DaemonStub(channel).StreamMetrics(
        daemon_pb2.StreamMetricsRequest(interval_seconds=0.05)
    )
    first = next(stream)
    assert first.host.hostname
    server.stop(grace=60.0)
    assert seen_at_stop == [NOT_SERVING]
    # The daemon ended the open stream itself: one still open when the grace ran out would be
    # cancelled by gRPC, and reading it would raise instead of ending cleanly.
    remaining = list(stream)
    assert all(r.host.hostname for r in remaining)
    channel.close()


def test_stream_metrics_follows_new_steps(daemon_server: DaemonServer, daemon_stub) -> None:
    # The fake rank finishes at once: ask for finished jobs too, or it may be gone when read.
    request = daemon_pb2.StreamMetricsRequest(interval_seconds=0.05, include_finished=True)
    stream = daemon_stub.StreamMetrics(request)
    assert list(next(stream).ranks) == []
    run_fake_rank(daemon_server.address, rank=1, steps=2, backend=FakeBackend())
    # The daemon ingests off the receiving thread: read on until the rank's last step shows
    # (a bound for a broken daemon only), whatever the stream sent while it caught up.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        response = next(stream)
        if [r.step for r in response.ranks] == [2]:
            break
    stream.cancel()
    # Steps 0 and 1 on the wire are steps 1 and 2 as the trainer numbers them.
    assert [(r.rank, r.step) for r in response.ranks] == [(1, 2)]


def test_error_statuses(daemon_stub) -> None:
    with pytest.raises(grpc.RpcError) as invalid_window:
        daemon_stub.GetBottleneck(daemon_pb2.GetBottleneckRequest(window_steps=-1))
    assert invalid_window.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as invalid:
        daemon_stub.CaptureTrace(daemon_pb2.CaptureTraceRequest(seconds=-1))
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as negative:
        daemon_stub.GetMetrics(daemon_pb2.GetMetricsRequest(window_steps=-3))
    assert negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_spans_from_other_sources_are_counted_not_stored(daemon_server, daemon_stub) -> None:
    provider = TracerProvider(resource=Resource.create({"service.name": "something-else"}))
    exporter = OTLPSpanExporter(endpoint=daemon_server.address, insecure=True, timeout=5)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.get_tracer("test").start_span("foreign").end()
    provider.shutdown()
    status = daemon_stub.Status(daemon_pb2.StatusRequest())
    assert (status.spans_ignored, status.spans_received, status.ranks) == (1, 0, 0)
    assert status.bind_address == daemon_server.address


def test_a_taken_port_is_an_error() -> None:
    with (
        DaemonServer("127.0.0.1:0", host_interval=0.2) as first,
        pytest.raises(OSError, match="could not bind"),
    ):
        DaemonServer(first.address, host_interval=0.2)
