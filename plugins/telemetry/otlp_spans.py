"""Records to OTLP span messages, built straight in protobuf (no OpenTelemetry SDK objects).

The exporter thread calls these; the training thread never does. The wire format is the one
the stock SDK exporter produces (`opentelemetry.proto.trace.v1.Span` inside an
`ExportTraceServiceRequest`), so the daemon, an OpenTelemetry Collector or Jaeger read it alike.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from plait.core import telemetry_schema as names
from plait.core.step import PhaseSpan, StepReport
from plait.plugins.telemetry.comm_records import CommRecord

_PRIMITIVES = (str, bool, int, float)
_INTERNAL = Span.SpanKind.SPAN_KIND_INTERNAL


def any_value(value: Any) -> AnyValue:
    # bool before int: a bool is an int in Python and must stay a bool on the wire.
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, list | tuple) and all(isinstance(v, _PRIMITIVES) for v in value):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    return AnyValue(string_value=str(value))


def key_values(attributes: Mapping[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=key, value=any_value(value)) for key, value in attributes.items()]


def new_trace_id() -> bytes:
    return os.urandom(16)


def new_span_id() -> bytes:
    return os.urandom(8)


def comm_attributes(record: CommRecord) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        names.SPAN_COMM_OP: record.op,
        names.SPAN_COMM_BYTES: record.nbytes,
        names.SPAN_COMM_DTYPE: str(record.dtype).removeprefix("torch.") if record.dtype else "",
        names.SPAN_COMM_GROUP: record.group_name,
        names.SPAN_COMM_GROUP_RANKS: list(record.group_ranks),
        names.SPAN_COMM_SEQ: record.seq,
        names.SPAN_COMM_PURPOSE: record.purpose,
        names.SPAN_COMM_ASYNC: record.async_op,
    }
    if record.peer is not None:
        attributes[names.SPAN_COMM_PEER] = record.peer
    if record.step is not None:
        attributes[names.SPAN_STEP] = record.step
    return attributes


def step_attributes(report: StepReport) -> dict[str, Any]:
    return {
        names.SPAN_STEP: report.step,
        names.SPAN_STEP_TOKENS: report.tokens,
        names.SPAN_STEP_MODEL_FLOPS: float(report.model_flops),
        names.SPAN_STEP_DATA_WAIT: report.data_wait_seconds,
        names.SPAN_STEP_LOSS: report.loss,
        names.SPAN_STEP_LR: report.lr,
        names.SPAN_STEP_GRAD_NORM: report.grad_norm if report.grad_norm is not None else -1.0,
        names.SPAN_STEP_SKIPPED: report.skipped,
    }


def phase_attributes(step: int, phase: PhaseSpan, skip: str = "") -> dict[str, Any]:
    attributes: dict[str, Any] = {names.SPAN_STEP: step, names.SPAN_PHASE: phase.name}
    if phase.microbatch is not None:
        attributes[names.SPAN_MICROBATCH] = phase.microbatch
    if phase.chunk is not None:
        attributes[names.SPAN_CHUNK] = phase.chunk
    for key, value in phase.attributes.items():
        if key != skip:
            attributes[names.SPAN_PHASE_ATTRIBUTE_PREFIX + key] = value
    return attributes


def span(
    name: str,
    *,
    trace_id: bytes,
    span_id: bytes,
    parent_span_id: bytes = b"",
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any],
    error: str = "",
) -> Span:
    message = Span(
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_span_id,
        name=name,
        kind=_INTERNAL,
        start_time_unix_nano=start_ns,
        end_time_unix_nano=end_ns,
        attributes=key_values(attributes),
    )
    if error:
        message.status.code = Status.STATUS_CODE_ERROR
        message.status.message = error
    return message


def export_request(
    resource: Sequence[KeyValue], scope: InstrumentationScope, spans: Iterable[Span]
) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=resource),
                scope_spans=[ScopeSpans(scope=scope, spans=spans)],
            )
        ]
    )
