"""What the training thread hands the span exporter: a comm record holds what its request said,
field by field; expert load and the end of the run are written as the OpenTelemetry SDK wrote
them when it built those spans, and sent after everything queued before them."""

from __future__ import annotations

import time

import pytest
import torch
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from plait.core.records import CommRequest
from plait.core.span_board import SpanBoard
from plait.daemon import telemetry_schema as names
from plait.daemon.decoder import decode_span
from plait.daemon.otlp_requests import attributes
from plait.plugins.expert_parallel.expert_load import publish_expert_load
from plait.plugins.telemetry.comm_records import CommRecord
from plait.plugins.telemetry.exporter import SpanExporter


def request(op: str, tensors: tuple[torch.Tensor, ...], **fields: object) -> CommRequest:
    settings: dict[str, object] = {"group_name": "tp", "group_ranks": (2, 3), "seq": 7}
    settings.update(fields)
    return CommRequest(op=op, tensors=tensors, group=None, **settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("made", "nbytes"),
    [
        (request("all_reduce", (torch.zeros(6, dtype=torch.bfloat16),), purpose="grad_bucket",
                 async_op=True), 12),
        # Gather and scatter count the rank's own operand, the second tensor.
        (request("all_gather", (torch.zeros(8), torch.zeros(4)), purpose="tp_activation"), 16),
        (request("reduce_scatter", (torch.zeros(2), torch.zeros(4, dtype=torch.float64))), 32),
        (request("send", (torch.zeros(3, 5)[:, :2],), peer=1), 24),  # a view: its own elements
        (request("barrier", ()), 0),
    ],
)  # fmt: skip
def test_a_record_copies_its_request(made: CommRequest, nbytes: int) -> None:
    before = time.time_ns()
    record = CommRecord.begin(made, step=4)
    assert record.nbytes == made.nbytes == nbytes
    assert (record.op, record.group_name, record.group_ranks, record.seq, record.purpose) == (
        made.op, made.group_name, made.group_ranks, made.seq, made.purpose,
    )  # fmt: skip
    assert (record.peer, record.async_op, record.step) == (made.peer, made.async_op, 4)
    assert record.dtype == (made.tensors[0].dtype if made.tensors else None)
    assert before <= record.start_ns <= time.time_ns() and record.end_ns == 0


def sent_spans(requests: list[bytes]) -> list[Span]:
    return [
        span
        for request in requests
        for resource in ExportTraceServiceRequest.FromString(request).resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]


def test_expert_load_and_the_end_of_run_go_out_as_the_sdk_wrote_them_and_last() -> None:
    board = SpanBoard()
    publish_expert_load(["moe.0", "moe.1"], torch.tensor([[3.0, 1.0], [0.0, 4.0]]),
                        torch.tensor([2.0, 0.0]), board=board)  # fmt: skip
    (published,) = board.take()
    assert board.take() == []
    sent: list[bytes] = []
    exporter = SpanExporter(send=sent.append, resource={names.RESOURCE_JOB_ID: "j"},
                            scope=("t", "0"), batch_delay=3600.0)  # fmt: skip
    exporter.put_job_end(names.JOB_OUTCOME_FINISHED, last_step=7)  # queued first, sent last
    exporter.put_published(published, 7)
    now = time.time_ns()
    exporter.put_comm([CommRecord("all_reduce", 8, torch.float32, "dp", (0, 1), 1, "metrics",
                                  None, False, 7, now, now + 5)])  # fmt: skip
    exporter.shutdown(30)
    spans = sent_spans(sent)
    assert [s.name for s in spans] == [names.EXPERT_LOAD_SPAN_NAME] * 2 + [
        "all_reduce", names.JOB_END_SPAN_NAME,
    ]  # fmt: skip

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("stock")
    for layer, tokens, dropped in (("moe.0", [3, 1], 2), ("moe.1", [0, 4], 0)):
        tracer.start_span(names.EXPERT_LOAD_SPAN_NAME, attributes={
            names.SPAN_STEP: 7, names.SPAN_MOE_LAYER: layer,
            names.SPAN_MOE_TOKENS_PER_EXPERT: tokens, names.SPAN_MOE_DROPPED: dropped,
        }).end()  # fmt: skip
    tracer.start_span(names.JOB_END_SPAN_NAME, attributes={
        names.SPAN_JOB_OUTCOME: names.JOB_OUTCOME_FINISHED, names.SPAN_STEP: 7,
    }).end()  # fmt: skip
    stock = [
        span
        for resource in encode_spans(memory.get_finished_spans()).resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    ours = [spans[0], spans[1], spans[3]]
    for mine, theirs in zip(ours, stock, strict=True):
        assert (mine.name, mine.kind, list(mine.attributes)) == (
            theirs.name, theirs.kind, list(theirs.attributes),
        )  # fmt: skip
        assert mine.start_time_unix_nano >= now - 10**9 and len(mine.trace_id) == 16

    loads = [decode_span(s.name, 0, 0, attributes(s.attributes)) for s in spans[:2]]
    assert [(d.step, d.expert_load) for d in loads] == [
        (7, type(loads[0].expert_load)("moe.0", (3, 1), 2)),
        (7, type(loads[0].expert_load)("moe.1", (0, 4), 0)),
    ]
    end = decode_span(spans[3].name, 0, 0, attributes(spans[3].attributes))
    assert (end.outcome, end.step) == (names.JOB_OUTCOME_FINISHED, 7)
