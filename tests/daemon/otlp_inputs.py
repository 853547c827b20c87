"""OTLP requests built by the stock OpenTelemetry SDK, and a probe of every daemon RPC.

Requests are encoded exactly as the SDK's OTLP/gRPC exporters encode them, then sent with a
plain stub so a test sees the daemon's response (partial success included).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util.types import Attributes

from plait.daemon import telemetry_schema as schema
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc

STEP_NS = 100_000_000


def rank_resource(job_id: str, rank: int, world_size: int = 2, **extra: Any) -> dict[str, Any]:
    return {
        schema.RESOURCE_JOB_ID: job_id,
        schema.RESOURCE_RANK: rank,
        schema.RESOURCE_WORLD_SIZE: world_size,
        schema.RESOURCE_HOST_NAME: "testhost",
        schema.RESOURCE_PEAK_FLOPS: 1e12,
        **extra,
    }


@dataclass(frozen=True, slots=True)
class SpanSpec:
    name: str
    start_ns: int
    end_ns: int
    attributes: Attributes


def step_spans(first_step: int, steps: int, base_ns: int, **overrides: Any) -> list[SpanSpec]:
    """Step spans with a forward phase each; `overrides` replace step span attributes."""
    out = []
    for step in range(first_step, first_step + steps):
        start = base_ns + step * STEP_NS
        attributes = {
            schema.SPAN_STEP: step,
            schema.SPAN_STEP_TOKENS: 1024,
            schema.SPAN_STEP_MODEL_FLOPS: 4e9,
            schema.SPAN_STEP_DATA_WAIT: 0.01,
            schema.SPAN_STEP_LOSS: 2.0,
            **overrides,
        }
        out.append(SpanSpec(schema.STEP_SPAN_NAME, start, start + STEP_NS, attributes))
        phase = {schema.SPAN_STEP: step, schema.SPAN_PHASE: schema.PHASE_FORWARD}
        out.append(SpanSpec(schema.PHASE_FORWARD, start, start + STEP_NS // 2, phase))
    return out


def trace_request(
    resource: Mapping[str, Any], spans: Sequence[SpanSpec]
) -> trace_service_pb2.ExportTraceServiceRequest:
    """What the SDK's OTLPSpanExporter would send for these spans under this resource."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(dict(resource)))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("plait.tests")
    for spec in spans:
        tracer.start_span(spec.name, start_time=spec.start_ns, attributes=spec.attributes).end(
            end_time=spec.end_ns
        )
    provider.shutdown()
    return encode_spans(memory.get_finished_spans())


def gauge_request(
    resource: Mapping[str, Any], name: str, value: float, attributes: Attributes = None
) -> metrics_service_pb2.ExportMetricsServiceRequest:
    """What the SDK's OTLPMetricExporter would send for one gauge point."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(resource=Resource.create(dict(resource)), metric_readers=[reader])
    provider.get_meter("plait.tests").create_gauge(name).set(value, attributes)
    data = reader.get_metrics_data()
    provider.shutdown()
    assert data is not None
    return encode_metrics(data)


@dataclass(frozen=True, slots=True)
class Probe:
    """Every query the daemon answers, after some input; `figures(job)` compares jobs."""

    metrics: daemon_pb2.GetMetricsResponse
    bottleneck: daemon_pb2.GetBottleneckResponse
    status: daemon_pb2.StatusResponse
    prometheus_status: int
    prometheus_text: str

    def figures(self, job_id: str) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """A job's ranks, job figures and bottleneck rows, serialised for comparison."""
        ranks = [r for r in self.metrics.ranks if r.job_id == job_id]
        for rank in ranks:
            rank.ClearField("otel_metrics")
            rank.ClearField("silent_seconds")  # time since the rank was heard from: it moves
        jobs = [j for j in self.metrics.jobs if j.job_id == job_id]
        for job in jobs:  # when this daemon heard the world: two daemons hear it apart
            job.ClearField("world_started_unix_nano")
            job.ClearField("last_heard_unix_nano")
            # How long ago a checkpoint ended, when the daemon answered: it moves.
            for save in ("last", "writing"):
                if job.checkpoints.HasField(save):
                    getattr(job.checkpoints, save).ClearField("age_seconds")
        return (
            [r.SerializeToString(deterministic=True) for r in ranks],
            [j.SerializeToString(deterministic=True) for j in jobs],
            [
                b.SerializeToString(deterministic=True)
                for b in self.bottleneck.ranks
                if b.job_id == job_id
            ],
        )


def any_value(value: Any) -> AnyValue:
    """A Python value as an OTLP `AnyValue`, built by hand (a dict becomes a key-value list),
    for inputs the SDK would never produce."""
    if value is None:
        return AnyValue()
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    return AnyValue(kvlist_value=KeyValueList(values=key_values(value)))


def key_values(attributes: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in attributes.items()]


def probe(server: DaemonServer) -> Probe:
    """Call every plait.v1 RPC and scrape /metrics; raises if any of them fails."""
    with grpc.insecure_channel(server.address) as channel:
        stub = daemon_pb2_grpc.DaemonStub(channel)
        status = stub.Status(daemon_pb2.StatusRequest(), timeout=10)
        stub.ListRanks(daemon_pb2.ListRanksRequest(), timeout=10)
        metrics = stub.GetMetrics(daemon_pb2.GetMetricsRequest(window_steps=50), timeout=10)
        stream = stub.StreamMetrics(
            daemon_pb2.StreamMetricsRequest(window_steps=50, interval_seconds=0.05), timeout=10
        )
        next(stream)
        stream.cancel()
        bottleneck = stub.GetBottleneck(
            daemon_pb2.GetBottleneckRequest(window_steps=50), timeout=10
        )
        stub.CaptureTrace(daemon_pb2.CaptureTraceRequest(seconds=0), timeout=10)
        # A job's questions, asked of every daemon of each job it holds (this one alone here).
        for job in metrics.jobs:
            stub.ListJobDaemons(daemon_pb2.ListJobDaemonsRequest(job_id=job.job_id), timeout=10)
            every = [
                daemon_pb2.JobQuestion(method=method, request=b"")
                for method in ("Daemon/Status", "Daemon/ListRanks", "Daemon/GetMetrics",
                               "Daemon/GetBottleneck", "Control/ListEndpoints")
            ]  # fmt: skip
            answered = stub.AskJob(
                daemon_pb2.AskJobRequest(job_id=job.job_id, questions=every), timeout=20
            )
            assert [a.error for a in answered.answers] == [""], answered
    assert server.prometheus is not None
    url = f"http://{server.prometheus.address}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        code, text = response.status, response.read().decode()
    return Probe(metrics, bottleneck, status, code, text)
