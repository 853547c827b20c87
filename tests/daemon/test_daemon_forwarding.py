"""Forwarding upstream like a collector: retried delivery, bounded memory, counted drops, and
oversize requests answered with a status that stock exporters do not retry."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from plait.daemon import telemetry_schema as schema
from plait.daemon.forwarding import (
    DROP_QUEUE_FULL,
    DROP_SHUTDOWN,
    Forwarder,
    Outgoing,
    RetryPolicy,
)
from plait.daemon.otlp_requests import attributes
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from tests.daemon.otlp_inputs import rank_resource, step_spans, trace_request
from tests.free_ports import refused_port

REJECTED = "rejected upstream: "
FAST_RETRY = RetryPolicy(initial_backoff_seconds=0.02, max_backoff_seconds=0.1, jitter=0.0)


class FlakyUpstream(trace_service_pb2_grpc.TraceServiceServicer):
    """A TraceService that fails the first `failures` rank requests with `code`."""

    def __init__(self, failures: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.failures, self.code = failures, code
        self.calls = 0
        self.received: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        ranks = [rs for rs in request.resource_spans
                 if schema.RESOURCE_JOB_ID in attributes(rs.resource.attributes)]  # fmt: skip
        if ranks:  # the daemon's own hang spans are not what this test counts
            with self.lock:
                self.calls += 1
                failing = self.calls <= self.failures
                if not failing:
                    self.received.append(request)
            if failing:
                context.abort(self.code, "upstream is flaky")
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def flaky() -> Iterator[FlakyUpstream]:
    upstream = FlakyUpstream(failures=3)
    upstream.server.start()
    try:
        yield upstream
    finally:
        upstream.server.stop(0.5).wait()


def _status(server: DaemonServer) -> daemon_pb2.StatusResponse:
    with grpc.insecure_channel(server.address) as channel:
        return daemon_pb2_grpc.DaemonStub(channel).Status(daemon_pb2.StatusRequest(), timeout=5)


def _status_once(
    server: DaemonServer, ready: Callable[[daemon_pb2.StatusResponse], bool]
) -> daemon_pb2.StatusResponse:
    """The first status `ready` accepts (the forwarder's thread gets there in its own time)."""
    deadline = time.monotonic() + 60
    while not ready(status := _status(server)):
        assert time.monotonic() < deadline, f"status never became ready: {status}"
        time.sleep(0.02)
    return status


def _export(server: DaemonServer, job: str, steps: int = 2) -> None:
    request = trace_request(rank_resource(job, 0), step_spans(0, steps, time.time_ns()))
    with grpc.insecure_channel(server.address) as channel:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=5)


def test_a_flaky_upstream_gets_the_request_after_retries(flaky: FlakyUpstream) -> None:
    server = DaemonServer(
        "127.0.0.1:0", host_interval=0.5, otlp_endpoint=f"http://127.0.0.1:{flaky.port}",
        otlp_retry=FAST_RETRY,
    ).start()  # fmt: skip
    try:
        _export(server, "flaky")
        # Counted once the upstream has answered (after it recorded the request).
        status = _status_once(server, lambda s: s.forwarder.forwarded_requests > 0)
    finally:
        server.stop(grace=0.5)
    assert flaky.calls == 4 and len(flaky.received) == 1
    (resource_spans,) = flaky.received[0].resource_spans
    assert attributes(resource_spans.resource.attributes)[schema.RESOURCE_JOB_ID] == "flaky"
    forwarder = status.forwarder
    assert (forwarder.forwarded_requests, forwarder.retries) == (1, 3)
    assert forwarder.dropped_requests == 0 and forwarder.endpoint.startswith("http://127.0.0.1:")


def test_a_dead_upstream_costs_bounded_memory_and_counted_drops() -> None:
    with refused_port() as dead_port:
        request_bytes = trace_request(
            rank_resource("dead", 0), step_spans(0, 2, time.time_ns())
        ).ByteSize()
        capacity = 3 * request_bytes + request_bytes // 2  # room for three requests
        server = DaemonServer(
            "127.0.0.1:0", host_interval=0.5, otlp_endpoint=f"http://127.0.0.1:{dead_port}",
            otlp_retry=RetryPolicy(initial_backoff_seconds=0.05, max_elapsed_seconds=600),
            otlp_queue_bytes=capacity,
        ).start()  # fmt: skip
        try:
            for _ in range(20):
                _export(server, "dead")
                queued = _status(server).forwarder
                assert queued.queued_bytes <= capacity == queued.queue_capacity_bytes
            status = _status_once(server, lambda s: s.forwarder.retries > 0)
            started = time.monotonic()
        finally:
            server.stop(grace=0.5)
        stop_seconds = time.monotonic() - started
    forwarder = status.forwarder
    # Backing off, not spinning: ~0.05 s doubling to 5 s (40 retries would take minutes).
    assert forwarder.forwarded_requests == 0 and 0 < forwarder.retries < 40
    assert forwarder.queued_requests == 3
    assert forwarder.dropped_by_reason[DROP_QUEUE_FULL] == 17
    assert forwarder.dropped_spans == 17 * 4  # two steps, each a step span and a phase span
    # Stopping gives up on the dead upstream and counts the rest, instead of spending the
    # retry budget (600 s): the bound is far from both, whatever the machine's load.
    assert stop_seconds < 60
    assert server.upstream is not None
    final = server.upstream.stats()
    assert final.dropped_by_reason[DROP_SHUTDOWN] == 3 and final.queued_bytes == 0
    assert final.retries < 60  # the flush backed off too


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, delay: float | None = None) -> None:
        self._code = code
        self._trailing: tuple[tuple[str, bytes], ...] = ()
        if delay is not None:
            info = RetryInfo(retry_delay=Duration(nanos=int(delay * 1e9)))
            self._trailing = (("google.rpc.retryinfo-bin", info.SerializeToString()),)

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._trailing


@pytest.mark.parametrize(
    ("error", "calls", "outcome"),
    [
        (FakeRpcError(grpc.StatusCode.UNAVAILABLE), 3, "delivered"),
        (FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED), 3, "delivered"),
        (FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, delay=0.01), 3, "delivered"),
        # No RetryInfo: the server cannot recover (too large, quota gone); never resent.
        (FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED), 1, REJECTED + "RESOURCE_EXHAUSTED"),
        (FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT), 1, REJECTED + "INVALID_ARGUMENT"),
    ],
)  # fmt: skip
def test_retry_rules_follow_the_otlp_specification(
    error: FakeRpcError, calls: int, outcome: str
) -> None:
    attempts: list[float] = []

    def call(request: Any, timeout: float, metadata: Any) -> Any:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise error
        return trace_service_pb2.ExportTraceServiceResponse()

    forwarder = Forwarder("test", policy=FAST_RETRY)
    forwarder.start()
    forwarder.put(Outgoing(call=call, request=None, metadata=(), nbytes=10, spans=2))
    forwarder.stop(flush_seconds=5)
    stats = forwarder.snapshot()
    assert len(attempts) == calls
    if outcome == "delivered":
        assert (stats.forwarded_requests, stats.retries, stats.dropped_requests) == (1, 2, 0)
    else:
        assert stats.dropped_by_reason == {outcome: 1} and stats.dropped_spans == 2


def test_backoff_grows_exponentially_up_to_its_cap() -> None:
    policy = RetryPolicy(initial_backoff_seconds=0.5, max_backoff_seconds=5.0, jitter=0.0)
    assert [policy.backoff(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert policy.backoff(100_000) == 5.0  # a long outage does not overflow


def test_an_oversize_request_is_refused_once_and_the_stock_exporter_does_not_retry() -> None:
    with DaemonServer("127.0.0.1:0", host_interval=0.5, max_message_bytes=64 * 1024) as server:
        memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create(rank_resource("big", 0)))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        provider.get_tracer("plait.tests").start_span(
            "step", attributes={"padding": "x" * 100_000}
        ).end()
        provider.shutdown()
        exporter = OTLPSpanExporter(endpoint=server.address, insecure=True, timeout=10)
        try:
            result = exporter.export(memory.get_finished_spans())
        finally:
            exporter.shutdown()
        status = _status(server)
    assert result is SpanExportResult.FAILURE
    # One call: `export` returns after its last attempt, and the daemon counts each refusal
    # before answering it, so a retry would show here as a second one.
    assert dict(status.calls_rejected_by_reason) == {"oversize": 1}
