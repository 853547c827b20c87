"""The wire reader's span templates give exactly what the protobuf message walk gives.

The reader remembers, per span layout, which attribute entries repeat (strings, bools, lists)
and copies their decoded values for later spans with the same entries, reading only the rest.
These tests feed it requests where layouts recur — as the stock OpenTelemetry SDK encodes
them, as plait's exporter encodes them, and random ones built from a small pool of entries
(a key given twice, a repeating entry moved, a number where a string was) — and compare every
span with the message walk (`TraceRequest.from_message`), the reference path.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from plait.core.step import PhaseSpan, StepReport
from plait.daemon import telemetry_schema as names
from plait.daemon.decoder import Rejected, StaticsCache, decode_span
from plait.daemon.otlp_requests import TraceRequest
from plait.daemon.otlp_wire import TraceRequestReader, WireSpan
from plait.plugins.telemetry.comm_records import CommRecord
from plait.plugins.telemetry.exporter import SpanExporter
from plait.plugins.telemetry.otlp_spans import comm_attributes, phase_attributes, step_attributes
from tests.daemon.otlp_inputs import any_value
from tests.daemon.test_daemon_otlp_wire import assert_same_reading

RESOURCE = {names.RESOURCE_JOB_ID: "j", names.RESOURCE_RANK: 0, names.RESOURCE_WORLD_SIZE: 2}


class CountingReader(TraceRequestReader):
    """Counts the spans served from a template."""

    def __init__(self) -> None:
        super().__init__()
        self.from_templates = 0

    def _from_template(self, entries: tuple[bytes, ...]) -> dict[str, Any] | None:
        attributes = super()._from_template(entries)
        self.from_templates += attributes is not None
        return attributes


def read_both_ways(reader: TraceRequestReader, data: bytes) -> int:
    """Read `data` with the reader and with the message walk, assert equal; spans read."""
    read = TraceRequest(reader.read(data), raw=data)
    walked = TraceRequest.from_message(ExportTraceServiceRequest.FromString(data))
    assert_same_reading(read, walked)
    return read.span_count


def comm_record(step: int, seq: int, purpose: str, peer: int | None = None) -> CommRecord:
    now = time.time_ns()
    return CommRecord(
        op="send" if peer is not None else "all_reduce", nbytes=4096 * (seq % 3 + 1),
        dtype=torch.bfloat16, group_name="dp", group_ranks=(0, 1, 2, 3), seq=seq,
        purpose=purpose, peer=peer, async_op=seq % 2 == 0, step=step, start_ns=now,
        end_ns=now + 10,
    )  # fmt: skip


def step_report(step: int) -> StepReport:
    end = time.time_ns()
    phases = (
        PhaseSpan(name="forward", start_ns=end - 9, end_ns=end - 5, microbatch=step % 2),
        PhaseSpan(name="backward", start_ns=end - 5, end_ns=end - 1, chunk=1),
        PhaseSpan(name="optimizer", start_ns=end - 1, end_ns=end, attributes={"zero": True}),
    )
    return StepReport(
        step=step, loss=2.5 - step / 10, tokens=512, step_seconds=0.01,
        data_wait_seconds=0.001 * step, model_flops=1e12, lr=1e-3, start_ns=end - 10,
        end_ns=end, spans=phases, grad_norm=None if step % 3 else 0.5,
    )  # fmt: skip


def test_the_stock_sdks_spans_read_from_templates_as_protobuf_reads_them() -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(RESOURCE))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("stock")
    for step in range(40):
        report = step_report(step)
        tracer.start_span(names.STEP_SPAN_NAME, attributes=step_attributes(report)).end()
        for phase in report.spans:
            tracer.start_span(phase.name, attributes=phase_attributes(step, phase)).end()
        for i, purpose in enumerate(("grad_bucket", "grad_bucket", "metrics")):
            record = comm_record(step, step * 4 + i, purpose, peer=1 if i == 2 else None)
            attributes = {k: list(v) if isinstance(v, tuple) else v
                          for k, v in comm_attributes(record).items()}  # fmt: skip
            tracer.start_span(record.op, attributes=attributes).end()
    data = encode_spans(memory.get_finished_spans()).SerializeToString()
    reader = CountingReader()
    spans = read_both_ways(reader, data)
    assert spans == 40 * 7
    assert reader.from_templates > spans * 0.8, "the templates were not used"
    assert read_both_ways(reader, data) == spans  # a second pass: every span from a template
    assert reader.from_templates > spans * 1.8


def test_plaits_exporter_spans_read_from_templates_as_protobuf_reads_them() -> None:
    sent: list[bytes] = []
    exporter = SpanExporter(send=sent.append, resource=RESOURCE, scope=("t", "0"),
                            batch_delay=3600.0, max_batch=64)  # fmt: skip
    for step in range(30):
        exporter.put_step(step_report(step))
        exporter.put_comm([comm_record(step, step * 3 + i, "grad_bucket") for i in range(3)])
    exporter.shutdown(30)
    reader = CountingReader()
    spans = sum(read_both_ways(reader, data) for data in sent)
    assert spans == 30 * 7
    assert reader.from_templates > spans * 0.8


# Entries of a small pool, so that random spans repeat layouts: strings, bools and lists (the
# repeating kind), numbers, and keys shared between kinds (a key given twice in one span).
POOL: list[tuple[str, Any]] = [
    ("plait.comm.op", "all_reduce"),
    ("plait.comm.op", "broadcast"),
    ("plait.comm.purpose", "grad_bucket"),
    ("plait.comm.async", True),
    ("plait.comm.group_ranks", [0, 1]),
    ("plait.comm.group_ranks", [True, "x"]),
    ("plait.phase", "forward"),
    ("plait.step", 7),
    ("plait.step", 8),
    ("plait.comm.seq", 2**40),
    ("plait.comm.seq", -3),
    ("plait.step.loss", 0.25),
    ("plait.comm.op", 5),
    ("x", ""),
    ("plait.step.model_flops", 1e9),
    ("plait.comm.op", ""),
]


def key_value(key: str, value: Any) -> KeyValue:
    entry = KeyValue(key=key)
    if isinstance(value, list):
        for item in value:
            entry.value.array_value.values.append(any_value(item))
    else:
        entry.value.CopyFrom(any_value(value))
    return entry


layouts = st.lists(st.integers(min_value=0, max_value=len(POOL) - 1), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(layouts, min_size=1, max_size=4), st.data())
def test_random_recurring_layouts_read_as_protobuf_reads_them(
    base_layouts: list[list[int]], data: st.DataObject
) -> None:
    reader = TraceRequestReader()  # templates learned from this example only
    request = ExportTraceServiceRequest()
    resource = request.resource_spans.add()
    resource.resource.attributes.extend(key_value(k, v) for k, v in RESOURCE.items())
    scope = resource.scope_spans.add()
    for i in range(data.draw(st.integers(min_value=2, max_value=30))):
        layout = list(data.draw(st.sampled_from(base_layouts)))
        if data.draw(st.integers(min_value=0, max_value=3)) == 0 and layout:  # a variation
            at = data.draw(st.integers(min_value=0, max_value=len(layout) - 1))
            layout[at] = data.draw(st.integers(min_value=0, max_value=len(POOL) - 1))
        span = Span(name=f"s{i % 2}", start_time_unix_nano=i, end_time_unix_nano=i + 1)
        span.attributes.extend(key_value(*POOL[p]) for p in layout)
        scope.spans.append(span)
    data_bytes = request.SerializeToString()
    read_both_ways(reader, data_bytes)
    read_both_ways(reader, data_bytes)  # again, with every layout learned


def test_a_key_given_twice_keeps_the_value_last_on_the_wire() -> None:
    """A template's repeating entry, and before it a number or string with the same key."""
    layouts = [[7, 0], [12, 0], [7, 0], [1, 0], [0, 12], [8, 0]]  # POOL indices
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for i, layout in enumerate(layouts):
        span = scope.spans.add(name="s", start_time_unix_nano=i, end_time_unix_nano=i)
        span.attributes.extend(key_value(*POOL[p]) for p in layout)
    reader = CountingReader()
    read_both_ways(reader, request.SerializeToString())
    assert reader.from_templates == 2  # the two spans whose keys are all different


def decoded(decode: Any, span: WireSpan) -> tuple[Any, ...]:
    """What the store would get from `span`: its record's figures, or the reject's reason."""
    try:
        r = decode(span.name, span.start_ns, span.end_ns, span.attributes, span.error)
    except Rejected as error:
        return ("rejected", error.key)
    return (r.kind, r.step, r.comm, r.step_figures, r.phase, r.outcome, r.expert_load)


def request_of(layouts: list[list[int]], names_: list[str]) -> bytes:
    request = ExportTraceServiceRequest()
    scope = request.resource_spans.add().scope_spans.add()
    for i, (layout, name) in enumerate(zip(layouts, names_, strict=True)):
        span = scope.spans.add(name=name, start_time_unix_nano=i, end_time_unix_nano=i + 1)
        span.attributes.extend(key_value(*POOL[p]) for p in layout)
    return request.SerializeToString()


def assert_shapes_decode_alike(data: bytes) -> int:
    """Every span decoded through the statics cache (by its shape) gives what the reference
    decoder gives it alone; returns how many spans had a shape."""
    reader, cache = TraceRequestReader(), StaticsCache()
    shaped = 0
    for _ in range(2):  # the second time, every shape's statics are cached
        for resource in reader.read(data):
            for span in resource.spans:
                shaped += span.shape is not None

                def by_shape(*args: Any, span: WireSpan = span) -> Any:
                    return cache.decode(*args, span.shape)

                assert decoded(by_shape, span) == decoded(decode_span, span), span
    return shaped


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(layouts, min_size=1, max_size=4), st.data())
def test_spans_of_one_shape_decode_as_each_decodes_alone(
    base_layouts: list[list[int]], data: st.DataObject
) -> None:
    count = data.draw(st.integers(min_value=2, max_value=30))
    spans = []
    for _ in range(count):
        layout = list(data.draw(st.sampled_from(base_layouts)))
        if data.draw(st.integers(min_value=0, max_value=3)) == 0 and layout:  # a variation
            at = data.draw(st.integers(min_value=0, max_value=len(layout) - 1))
            layout[at] = data.draw(st.integers(min_value=0, max_value=len(POOL) - 1))
        spans.append(layout)
    names_ = [data.draw(st.sampled_from(["step", "forward", "all_reduce"])) for _ in spans]
    assert_shapes_decode_alike(request_of(spans, names_))


def test_a_number_where_a_string_belongs_is_another_shape() -> None:
    """Same repeating entries, same entry count: a phase span with a step number, then one with
    a number as its op (a collective, and a bad one). The second must not reuse the first's
    statics (a phase): its shape names the keys of its numbers."""
    phase, step, numeric_op, flops = 6, 7, 12, 14  # POOL indices
    layouts = [[phase, step], [phase, numeric_op], [phase, step], [phase, flops]]
    # The first span teaches the reader its layout; every other one has a shape.
    assert assert_shapes_decode_alike(request_of(layouts, ["step"] * 4)) == 7
    reader, cache = TraceRequestReader(), StaticsCache()
    spans = reader.read(request_of(layouts, ["step"] * 4))[0].spans
    results = [decoded(lambda *a, s=s: cache.decode(*a, s.shape), s) for s in spans]
    assert results[1] == ("rejected", "plait.comm.op: wrong type")
    assert results[0][0] == results[2][0] == results[3][0] == "phase"


def test_a_span_with_other_repeating_entries_is_not_decoded_with_their_statics() -> None:
    """An op that fails (empty) is never cached; spans named differently are different shapes."""
    good, empty_op, purpose, step, flops, text = 0, 15, 2, 7, 14, 13
    layouts = [[good, purpose, step], [empty_op, purpose, step], [empty_op, purpose, step]]
    assert assert_shapes_decode_alike(request_of(layouts, ["all_reduce", "x", "x"])) == 4
    # Only a span named "step" with FLOPs is a step span.
    assert assert_shapes_decode_alike(request_of([[text, flops, step]] * 2, ["a", "step"])) == 3
