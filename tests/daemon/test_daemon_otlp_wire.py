"""The daemon's wire reader reads what the protobuf message walk reads, or declines.

Random requests are built with the official classes (any attribute value, spans with and
without status, events, several resources and scopes), serialized, and read both ways; byte
strings cut at random places and with random bytes flipped must be declined or read exactly
as protobuf reads them, and never raise anything else.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from plait.daemon.otlp_requests import TraceRequest, trace_request_parser
from plait.daemon.otlp_wire import Decline, TraceRequestReader
from tests.daemon.test_daemon_fuzz import key_values, values

keys = st.one_of(st.sampled_from(["plait.step", "plait.comm.seq", "plait.rank"]), st.text())
plain_scalars = st.one_of(
    st.text(max_size=8),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(min_value=0, max_value=300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
)
# Mostly values the reader reads itself; sometimes the fuzz test's (bytes, kvlists), declined.
plain_values = st.one_of(plain_scalars, st.lists(plain_scalars, max_size=3))
attribute_maps = st.dictionaries(keys, st.one_of(*[plain_values] * 30, values), max_size=6)


@st.composite
def spans(draw: st.DrawFn) -> Span:
    span = Span(
        trace_id=draw(st.binary(min_size=16, max_size=16)),
        span_id=draw(st.binary(min_size=8, max_size=8)),
        parent_span_id=draw(st.sampled_from([b"", b"p" * 8])),
        name=draw(st.text(max_size=12)),
        kind=draw(st.integers(min_value=0, max_value=5)),
        start_time_unix_nano=draw(st.integers(min_value=0, max_value=2**64 - 1)),
        end_time_unix_nano=draw(st.integers(min_value=0, max_value=2**64 - 1)),
        attributes=key_values(draw(attribute_maps)),
        trace_state=draw(st.sampled_from(["", "k=v"])),
    )
    if draw(st.booleans()):
        span.status.CopyFrom(
            Status(code=draw(st.sampled_from([0, 1, 2])), message=draw(st.text(max_size=5)))
        )
    if draw(st.integers(min_value=0, max_value=29)) == 0:
        span.events.add(name="event")
    return span


@st.composite
def requests(draw: st.DrawFn) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        resource_spans = ResourceSpans(
            resource=Resource(attributes=key_values(draw(attribute_maps)))
        )
        for _ in range(draw(st.integers(min_value=0, max_value=2))):
            scope = InstrumentationScope(name=draw(st.text(max_size=5)), version="1")
            resource_spans.scope_spans.append(
                ScopeSpans(scope=scope, spans=draw(st.lists(spans(), max_size=4)))
            )
        request.resource_spans.append(resource_spans)
    return request


def same(a: Any, b: Any) -> bool:
    """Equality where NaN equals NaN and a bool is never an int."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def assert_same_reading(read: TraceRequest, walked: TraceRequest) -> None:
    assert len(read.resources) == len(walked.resources)
    for mine, theirs in zip(read.resources, walked.resources, strict=True):
        assert same(mine.attributes, theirs.attributes)
        assert len(mine.spans) == len(theirs.spans)
        for a, b in zip(mine.spans, theirs.spans, strict=True):
            assert (a.scope_index, a.span_index, a.name) == (b.scope_index, b.span_index, b.name)
            assert (a.start_ns, a.end_ns, a.error) == (b.start_ns, b.end_ns, b.error)
            assert same(a.attributes, b.attributes)


READER = TraceRequestReader()  # one reader across examples: its caches are exercised too


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_the_reader_reads_what_protobuf_reads(request: ExportTraceServiceRequest) -> None:
    data = request.SerializeToString()
    walked = TraceRequest.from_message(ExportTraceServiceRequest.FromString(data))
    try:
        read = TraceRequest(READER.read(data), raw=data)
    except Decline:
        return  # protobuf reads it instead (kvlists, bytes values, events)
    assert_same_reading(read, walked)
    assert read.message == request  # what is forwarded upstream is the request as received


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.data())
def test_damaged_bytes_are_declined_or_read_as_protobuf_reads_them(
    request: ExportTraceServiceRequest, data: st.DataObject
) -> None:
    raw = bytearray(request.SerializeToString())
    if not raw:
        return
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        at = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
        raw[at] = data.draw(st.integers(min_value=0, max_value=255))
    damaged = bytes(raw[: data.draw(st.integers(min_value=0, max_value=len(raw)))])
    try:
        message = ExportTraceServiceRequest.FromString(damaged)
    except DecodeError:
        message = None
    try:
        read = TraceRequest(READER.read(damaged), raw=damaged)
    except Decline:
        return
    assert message is not None, "the reader accepted bytes protobuf rejects"
    assert_same_reading(read, TraceRequest.from_message(message))


def test_the_parser_falls_back_to_protobuf_and_protobuf_rejects_garbage() -> None:
    parse = trace_request_parser()
    with_bytes_value = ExportTraceServiceRequest()
    with_bytes_value.resource_spans.add().resource.attributes.add(key="k").value.bytes_value = b"x"
    parsed = parse(with_bytes_value.SerializeToString())
    assert parsed.resources[0].attributes == {"k": b"x"}  # read by the message walk
    with pytest.raises(DecodeError):
        parse(b"\x0a\xff\xff\xff")
