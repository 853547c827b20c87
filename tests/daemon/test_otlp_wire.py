"""The hand-written OTLP encoder against the official protobuf classes."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from plait.daemon.otlp_requests import attributes as decoded
from plait.plugins.telemetry import otlp_wire

VALUES: dict[str, Any] = {
    "str": "all_reduce",
    "long": "x" * 300,  # lengths over 127 take two varint bytes
    "unicode": "grüße",
    "true": True,
    "false": False,
    "zero": 0,
    "int": 123_456_789_012,
    "negative": -5,
    "int64_max": 2**63 - 1,
    "float": 2.5e-7,
    "nan-free": -0.0,
    "ints": (0, 1, 300),
    "mixed": ["a", 1, 2.0, True],
    "empty": [],
    "object": object,  # anything else is sent as its string
}


@pytest.mark.parametrize("cached", [False, True])
def test_spans_parse_with_the_official_classes(cached: bool) -> None:
    encoder = otlp_wire.AttributeEncoder()
    if cached:  # second encoding comes from the cache
        encoder.attributes(VALUES)
    encoded = [
        encoder.span(
            "all_reduce", trace_id=b"t" * 16, span_id=b"s" * 8, parent_span_id=b"p" * 8,
            start_ns=1_700_000_000_000_000_000, end_ns=1_700_000_000_000_000_500,
            attributes=VALUES, error="RuntimeError: " + "e" * 200,
        ),
        encoder.span(
            "step", trace_id=b"u" * 16, span_id=b"v" * 8, start_ns=0, end_ns=2**64 - 1,
            attributes=encoder.int_value("plait.step", 7) + encoder.int_value("big", 2**40),
        ),
    ]  # fmt: skip
    request = ExportTraceServiceRequest.FromString(
        otlp_wire.export_request(
            otlp_wire.resource_attributes({"plait.job.id": "j", "plait.rank": 3}),
            otlp_wire.scope("plait.telemetry", "1.0"),
            encoded,
        )
    )
    (resource_spans,) = request.resource_spans
    assert decoded(resource_spans.resource.attributes) == {"plait.job.id": "j", "plait.rank": 3}
    (scope_spans,) = resource_spans.scope_spans
    assert (scope_spans.scope.name, scope_spans.scope.version) == ("plait.telemetry", "1.0")
    first, second = scope_spans.spans
    assert (first.trace_id, first.span_id, first.parent_span_id) == (b"t" * 16, b"s" * 8, b"p" * 8)
    assert first.name == "all_reduce" and first.kind == Span.SpanKind.SPAN_KIND_INTERNAL
    assert first.end_time_unix_nano - first.start_time_unix_nano == 500
    assert first.status.code == Status.STATUS_CODE_ERROR and first.status.message.endswith("e")
    expected = dict(VALUES, ints=[0, 1, 300], mixed=["a", 1, 2.0, True], object=str(object))
    got = decoded(first.attributes)
    assert got == expected
    assert type(got["true"]) is bool and type(got["zero"]) is int and type(got["float"]) is float
    assert decoded(second.attributes) == {"plait.step": 7, "big": 2**40}
    assert second.parent_span_id == b"" and second.end_time_unix_nano == 2**64 - 1
    assert second.status.code == Status.STATUS_CODE_UNSET


def test_one_true_and_one_int_are_different_values_in_the_cache() -> None:
    encoder = otlp_wire.AttributeEncoder()
    assert encoder.key_value("k", True) != encoder.key_value("k", 1)
    assert encoder.key_value("k", 1) != encoder.key_value("k", 1.0)
