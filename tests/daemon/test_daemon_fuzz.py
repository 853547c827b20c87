"""Property: random attribute values and types through the real OTLP endpoint never break the
daemon. Every RPC and `/metrics` keep answering and a healthy job's figures do not move.

Requests are raw protobuf, so values no SDK would send (NaN gauges, byte strings where numbers
belong, nested lists, empty values) reach the daemon too. Items start from a valid rank, span or
heartbeat and have random attributes replaced, so most examples get past the first check.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    Gauge,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from plait.daemon import telemetry_schema as schema
from plait.daemon.server import DaemonServer
from tests.daemon.otlp_inputs import (
    key_values,
    probe,
    rank_resource,
    step_spans,
    trace_request,
)

GOOD = "good"
RESOURCE_KEYS = [
    schema.RESOURCE_JOB_ID, schema.RESOURCE_RANK, schema.RESOURCE_LOCAL_RANK,
    schema.RESOURCE_WORLD_SIZE, schema.RESOURCE_DEVICE, schema.RESOURCE_PEAK_FLOPS,
    schema.RESOURCE_NUM_PARAMS, schema.RESOURCE_FLOPS_PER_TOKEN, schema.RESOURCE_TOKENS_PER_STEP,
    schema.RESOURCE_PROCESS_PID, schema.RESOURCE_HOST_NAME,
    schema.RESOURCE_MESH_COORD_PREFIX + "tp", schema.RESOURCE_MESH_DEGREE_PREFIX + "tp",
]  # fmt: skip
SPAN_KEYS = [
    schema.SPAN_STEP, schema.SPAN_STEP_TOKENS, schema.SPAN_STEP_MODEL_FLOPS,
    schema.SPAN_STEP_DATA_WAIT, schema.SPAN_STEP_LOSS, schema.SPAN_PHASE, schema.SPAN_COMM_OP,
    schema.SPAN_COMM_BYTES, schema.SPAN_COMM_ASYNC, schema.SPAN_COMM_PURPOSE,
    schema.SPAN_COMM_GROUP, schema.SPAN_COMM_GROUP_RANKS, schema.SPAN_COMM_SEQ,
    schema.SPAN_COMM_PEER,
]  # fmt: skip
METRIC_NAMES = [
    schema.METRIC_COMM_HEARTBEAT, schema.METRIC_COMM_INFLIGHT, schema.METRIC_COMM_ENTERED,
    schema.METRIC_DEVICE_MEMORY_USED, schema.METRIC_TRAIN_LOSS,
]  # fmt: skip

scalars = st.one_of(
    st.text(max_size=8),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, 1, -1, 2, 2**31, 2**31 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.binary(max_size=4),
    st.none(),
)
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.dictionaries(st.text(max_size=3), scalars, max_size=2),
)


def overrides(keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    # Often none at all, so a valid item carries the other random parts deep into the daemon.
    return st.one_of(st.just({}), st.dictionaries(st.sampled_from(keys), values, max_size=3))


# Edge values first: the ones that break conversions to int64 and divisions.
gauge_values = st.one_of(
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, -1.0, 0.0, 2.0**63]),
    st.floats(allow_nan=True, allow_infinity=True),
)


SPAN_BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "step": (schema.STEP_SPAN_NAME, {schema.SPAN_STEP: 1, schema.SPAN_STEP_MODEL_FLOPS: 1e9,
                                     schema.SPAN_STEP_TOKENS: 64}),
    "phase": (schema.PHASE_FORWARD, {schema.SPAN_STEP: 1, schema.SPAN_PHASE: schema.PHASE_FORWARD}),
    "comm": ("all_reduce", {schema.SPAN_STEP: 1, schema.SPAN_COMM_OP: "all_reduce",
                            schema.SPAN_COMM_BYTES: 64, schema.SPAN_COMM_GROUP: "dp",
                            schema.SPAN_COMM_GROUP_RANKS: [0, 1], schema.SPAN_COMM_SEQ: 3}),
}  # fmt: skip


@st.composite
def fuzz_requests(
    draw: st.DrawFn,
) -> tuple[
    trace_service_pb2.ExportTraceServiceRequest, metrics_service_pb2.ExportMetricsServiceRequest
]:
    resource = {**rank_resource("fuzz", 0), **draw(overrides(RESOURCE_KEYS))}
    now = time.time_ns()
    spans = []
    for kind in draw(st.lists(st.sampled_from(sorted(SPAN_BASES)), min_size=1, max_size=4)):
        name, base = SPAN_BASES[kind]
        start = now + draw(st.integers(-(10**9), 10**9))
        end = start + draw(st.integers(-(10**6), 10**9))
        spans.append(
            Span(
                name=name,
                start_time_unix_nano=max(start, 0),
                end_time_unix_nano=max(end, 0),
                attributes=key_values({**base, **draw(overrides(SPAN_KEYS))}),
            )
        )
    traces = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(scope_spans=[ScopeSpans(spans=spans)]),
        ]
    )
    traces.resource_spans[0].resource.attributes.extend(key_values(resource))
    metrics = []
    # A heartbeat first, so in-flight and entered points are turned into hang state.
    names = [schema.METRIC_COMM_HEARTBEAT]
    for name in names + draw(st.lists(st.sampled_from(METRIC_NAMES), min_size=1, max_size=3)):
        value = draw(gauge_values)
        attributes = {schema.SPAN_COMM_GROUP: "dp", schema.SPAN_COMM_GROUP_RANKS: [0, 1],
                      **draw(overrides(SPAN_KEYS))}  # fmt: skip
        point = NumberDataPoint(
            time_unix_nano=now, as_double=value, attributes=key_values(attributes)
        )
        metrics.append(Metric(name=name, gauge=Gauge(data_points=[point])))
    points = metrics_service_pb2.ExportMetricsServiceRequest(
        resource_metrics=[ResourceMetrics(scope_metrics=[ScopeMetrics(metrics=metrics)])]
    )
    points.resource_metrics[0].resource.attributes.extend(key_values(resource))
    return traces, points


def test_random_attributes_never_break_the_daemon() -> None:
    # The healthy job never goes stale while the examples run (its figures must not move).
    server = DaemonServer(
        "127.0.0.1:0",
        host_interval=0.5,
        prometheus="127.0.0.1:0",
        stale_floor=3600.0,
        stale_ceiling=3600.0,
    ).start()
    channel = grpc.insecure_channel(server.address)
    try:
        traces = trace_service_pb2_grpc.TraceServiceStub(channel)
        metrics = metrics_service_pb2_grpc.MetricsServiceStub(channel)
        base_ns = time.time_ns() - 10**9
        for rank in (0, 1):
            traces.Export(trace_request(rank_resource(GOOD, rank), step_spans(0, 5, base_ns)))
        before = probe(server).figures(GOOD)

        @settings(
            max_examples=80,
            deadline=5000,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(fuzz_requests())
        def export_then_probe(requests: tuple[Any, Any]) -> None:
            span_request, metric_request = requests
            # Any answer is fine as long as it is an answer: no exception leaves the RPC.
            traces.Export(span_request, timeout=5)
            metrics.Export(metric_request, timeout=5)
            after = probe(server)
            assert after.prometheus_status == 200
            assert after.figures(GOOD) == before

        export_then_probe()
        status = probe(server).status
        # The examples did exercise the door: some items were rejected, for several reasons.
        assert status.spans_rejected > 0 and status.metric_points_rejected > 0
        assert len(status.rejected_by_reason) >= 5, dict(status.rejected_by_reason)
    finally:
        channel.close()
        server.stop(grace=0.5)
