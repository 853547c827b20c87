"""No input poisons the daemon: bad attributes are rejected alone, counted, never forwarded.

Each case is one of the inputs that used to break a node (checked with the stock SDK): the
daemon must reject just that item through OTLP partial success, keep answering every RPC and
`/metrics`, leave the other job's figures unchanged, and keep the item from going upstream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rich.console import Console
from typer.testing import CliRunner

from plait.daemon import telemetry_schema as schema
from plait.daemon.server import DaemonServer
from plait.tools import daemon_commands
from plait.tools.daemon_commands import app
from tests.daemon.otlp_inputs import (
    gauge_request,
    probe,
    rank_resource,
    step_spans,
    trace_request,
)
from tests.daemon.otlp_sink import OtlpSink

GOOD, BAD = "good", "bad"


@dataclass
class Node:
    server: DaemonServer
    sink: OtlpSink
    traces: trace_service_pb2_grpc.TraceServiceStub
    metrics: metrics_service_pb2_grpc.MetricsServiceStub
    base_ns: int


@pytest.fixture(params=[0, 2], ids=["in-daemon", "ingest-workers"])
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    """A daemon forwarding to a sink, with a healthy 2-rank job "good" already reported; it
    decodes trace requests itself, or hands every one to two ingest worker processes."""
    with OtlpSink() as sink:
        server = DaemonServer(
            "127.0.0.1:0",
            host_interval=0.2,
            otlp_endpoint=sink.endpoint,
            prometheus="127.0.0.1:0",
            ingest_workers=request.param,
            ingest_offload_bytes=0,
            # The healthy job never goes stale during a test (its figures must not move).
            stale_floor=3600.0,
            stale_ceiling=3600.0,
        ).start()
        channel = grpc.insecure_channel(server.address)
        try:
            traces = trace_service_pb2_grpc.TraceServiceStub(channel)
            base_ns = time.time_ns() - 10**9
            for rank in (0, 1):
                request = trace_request(rank_resource(GOOD, rank), step_spans(0, 5, base_ns))
                assert not traces.Export(request, timeout=5).HasField("partial_success")
            yield Node(
                server, sink, traces, metrics_service_pb2_grpc.MetricsServiceStub(channel), base_ns
            )
        finally:
            channel.close()
            server.stop(grace=0.5)


def _answers_and_good_job_unchanged(node: Node, before: Any) -> Any:
    after = probe(node.server)
    assert after.prometheus_status == 200
    # With workers, every trace request was decoded by one of them.
    assert after.status.ingest_workers == (2 if node.server.ingest_pool else 0)
    assert (after.status.ingest_worker_requests > 0) == (node.server.ingest_pool is not None)
    assert after.figures(GOOD) == before.figures(GOOD)
    good_jobs = [j for j in after.metrics.jobs if j.job_id == GOOD]
    assert good_jobs and good_jobs[0].mfu > 0
    return after


def _never_forwarded(node: Node, predicate: Any) -> None:
    node.server.stop(grace=0.5)  # flushes the forwarder
    with node.sink.lock:
        assert not any(predicate(resource, span) for resource, span in node.sink.spans)
        assert not any(predicate(resource, metric) for resource, metric in node.sink.metrics)


SPAN_CASES = {
    "span step 'abc'": (rank_resource(BAD, 0), {schema.SPAN_STEP: "abc"}, "plait.step: wrong type"),
    "resource rank 'zero'": (
        rank_resource(BAD, 0, **{schema.RESOURCE_RANK: "zero"}),
        {},
        "plait.rank: wrong type",
    ),
    "resource peak_flops 'fast'": (
        rank_resource(BAD, 0, **{schema.RESOURCE_PEAK_FLOPS: "fast"}),
        {},
        "plait.device.peak_flops: wrong type",
    ),
    "resource world_size 0": (
        rank_resource(BAD, 0, **{schema.RESOURCE_WORLD_SIZE: 0}),
        {},
        "plait.world_size: out of range",
    ),
    "resource rank past world_size": (
        rank_resource(BAD, 2, **{schema.RESOURCE_WORLD_SIZE: 2}),
        {},
        "plait.rank: out of range",
    ),
    "step flops infinite": (
        rank_resource(BAD, 0),
        {schema.SPAN_STEP_MODEL_FLOPS: float("inf")},
        "plait.step.model_flops: not finite",
    ),
}


@pytest.mark.parametrize("case", sorted(SPAN_CASES))
def test_a_poisoned_span_or_resource_is_rejected_alone(node: Node, case: str) -> None:
    resource, overrides, reason = SPAN_CASES[case]
    before = probe(node.server)
    bad_steps = step_spans(0, 3, node.base_ns, **overrides)
    # A healthy rank's spans in the same request must still be stored.
    request = trace_request(resource, bad_steps)
    request.resource_spans.extend(
        trace_request(rank_resource(BAD, 1), step_spans(0, 3, node.base_ns)).resource_spans
    )

    response = node.traces.Export(request, timeout=5)

    rejected_whole_resource = not overrides
    expected = len(bad_steps) if rejected_whole_resource else 3  # only the step spans are bad
    assert response.partial_success.rejected_spans == expected
    assert reason.split(":")[0] in response.partial_success.error_message
    after = _answers_and_good_job_unchanged(node, before)
    assert dict(after.status.rejected_by_reason) == {reason: expected}
    assert after.status.spans_rejected == expected
    bad_ranks = sorted(r.rank for r in after.metrics.ranks if r.job_id == BAD)
    assert bad_ranks == ([1] if rejected_whole_resource else [0, 1])

    def bad_item(resource: dict[str, Any], span: Any) -> bool:
        if resource.get(schema.RESOURCE_JOB_ID) != BAD:
            return False
        if rejected_whole_resource:
            return resource.get(schema.RESOURCE_RANK) != 1
        return any(kv.key == schema.SPAN_STEP and kv.value.string_value for kv in span.attributes)

    _never_forwarded(node, bad_item)
    # The healthy rank of the bad job did go upstream.
    assert node.sink.wait_for(
        lambda s: any(r.get(schema.RESOURCE_JOB_ID) == BAD for r, _ in s.spans), timeout=1
    )


def test_poisoned_metrics_are_rejected_alone(node: Node) -> None:
    before = probe(node.server)
    zero_world = rank_resource(BAD, 0, **{schema.RESOURCE_WORLD_SIZE: 0})
    response = node.metrics.Export(gauge_request(zero_world, "plait.train.loss", 1.0), timeout=5)
    assert response.partial_success.rejected_data_points == 1
    assert "plait.world_size" in response.partial_success.error_message
    # A device memory gauge that cannot be an int64 byte count (the SDK refuses NaN itself;
    # the property test sends NaN raw).
    memory = gauge_request(rank_resource(BAD, 1), schema.METRIC_DEVICE_MEMORY_USED, 1e30)
    response = node.metrics.Export(memory, timeout=5)
    assert response.partial_success.rejected_data_points == 1
    # A heartbeat whose in-flight op starts at an impossible time.
    heartbeat = gauge_request(rank_resource(BAD, 1), schema.METRIC_COMM_INFLIGHT, 1e20)
    assert node.metrics.Export(heartbeat, timeout=5).partial_success.rejected_data_points == 1

    after = _answers_and_good_job_unchanged(node, before)
    assert dict(after.status.rejected_by_reason) == {
        "plait.world_size: out of range": 1,
        "plait.device.memory.used: out of range": 1,
        "plait.comm.inflight: out of range": 1,
    }
    assert after.status.metric_points_rejected == 3
    _never_forwarded(node, lambda resource, _: resource.get(schema.RESOURCE_JOB_ID) == BAD)


def test_stock_exporter_succeeds_for_the_good_spans_of_a_mixed_batch(node: Node) -> None:
    """Partial success is success for the SDK: no retry, no lost batch, the good spans kept."""
    exporter = OTLPSpanExporter(endpoint=node.server.address, insecure=True, timeout=5)
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(rank_resource(BAD, 0)))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("plait.tests")
    for spec in step_spans(0, 4, node.base_ns):
        tracer.start_span(spec.name, start_time=spec.start_ns, attributes=spec.attributes).end(
            end_time=spec.end_ns
        )
    tracer.start_span("step", attributes={schema.SPAN_STEP: "abc"}).end()
    provider.shutdown()
    try:
        assert exporter.export(memory.get_finished_spans()) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
    after = probe(node.server)
    (rank,) = [r for r in after.metrics.ranks if r.job_id == BAD]
    assert rank.window_steps == 4
    assert dict(after.status.rejected_by_reason) == {"plait.step: wrong type": 1}


def test_cli_keeps_working_and_status_names_the_reason(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon_commands, "console", Console(width=220))
    bad = trace_request(
        rank_resource(BAD, 0, **{schema.RESOURCE_WORLD_SIZE: 0}), step_spans(0, 2, node.base_ns)
    )
    node.traces.Export(bad, timeout=5)
    runner = CliRunner()
    top = runner.invoke(app, ["top", "--once", "--host", node.server.address])
    assert top.exit_code == 0, top.output
    status = runner.invoke(app, ["status", "--host", node.server.address])
    assert status.exit_code == 0, status.output
    assert "plait.world_size: out of range" in status.output
