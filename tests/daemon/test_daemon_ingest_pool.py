"""Ingest workers: trace requests decoded in other processes store exactly what the daemon
would have stored itself, and no malformed request or dead worker costs a span or the daemon.

The requests are what plait's own exporter sends (steps, phases, collectives, expert load, the
end of the run) plus a stock SDK's spans, a resource that is not a rank and rejected items.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from rich.console import Console
from typer.testing import CliRunner

from plait.core.span_board import SpanBoard
from plait.core.step import PhaseSpan, StepReport
from plait.daemon import telemetry_schema as schema
from plait.daemon.decoder import Rejected, StaticsCache
from plait.daemon.ingest import DecodedResource, decode_resources, decode_wire, encode_resources
from plait.daemon.otlp_requests import trace_request_parser
from plait.daemon.server import DaemonServer
from plait.plugins.expert_parallel.expert_load import publish_expert_load
from plait.plugins.telemetry.comm_records import CommRecord
from plait.plugins.telemetry.exporter import SpanExporter
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from plait.tools import daemon_commands
from plait.tools.bench.daemon_load import encoded_rank_requests
from plait.tools.bench.ingest_costs import STAGES, one_round
from plait.tools.daemon_commands import app
from tests.daemon.otlp_inputs import probe, rank_resource, step_spans, trace_request

JOB = "pooled"
STEP_NS = 50_000_000


def plait_requests(rank: int, steps: int, base_ns: int) -> list[bytes]:
    """One rank's spans as plait's exporter encodes them, in requests of up to 64 spans."""
    sent: list[bytes] = []
    exporter = SpanExporter(
        send=sent.append,
        resource=rank_resource(JOB, rank),
        scope=("plait.telemetry", "test"),
        batch_delay=3600.0,
        max_batch=64,
    )
    board = SpanBoard()
    for step in range(steps):
        start = base_ns + step * STEP_NS
        middle, end = start + STEP_NS // 2, start + STEP_NS
        phases = (
            PhaseSpan(name="forward", start_ns=start, end_ns=middle, microbatch=0),
            PhaseSpan(name="backward", start_ns=middle, end_ns=end, microbatch=0),
        )
        exporter.put_step(
            StepReport(
                step=step, loss=2.0 + step, tokens=1024, step_seconds=STEP_NS / 1e9,
                data_wait_seconds=0.001, model_flops=4e9, lr=1e-3, start_ns=start, end_ns=end,
                spans=phases,
            )
        )  # fmt: skip
        exporter.put_comm(
            [
                CommRecord(
                    "all_reduce",
                    4 << 20,
                    torch.float32,
                    "dp",
                    (0, 1),
                    step * 4 + i,
                    "grad_bucket",
                    None,
                    i % 2 == 0,
                    step,
                    middle + i,
                    end - i,
                )
                for i in range(4)
            ]
        )
        publish_expert_load(
            ["moe.0"], torch.tensor([[3.0 + step, 1.0]]), torch.tensor([1.0]), board=board
        )
        (published,) = board.take()
        exporter.put_published(published, step)
    exporter.put_job_end(schema.JOB_OUTCOME_FINISHED, last_step=steps - 1)
    exporter.shutdown(30)
    return sent


def mixed_request(base_ns: int) -> bytes:
    """A stock SDK's request: a rank with one bad step span, a rejected resource, and a
    resource that is not a rank at all."""
    request = trace_request(
        rank_resource(JOB, 2, world_size=4),
        step_spans(0, 3, base_ns) + step_spans(3, 1, base_ns, **{schema.SPAN_STEP: "abc"}),
    )
    for resource in (
        rank_resource(JOB, 3, world_size=0),
        {"service.name": "not-plait"},
    ):
        request.resource_spans.extend(
            trace_request(resource, step_spans(0, 2, base_ns)).resource_spans
        )
    return request.SerializeToString()


@pytest.fixture(scope="module")
def requests() -> list[bytes]:
    base_ns = time.time_ns() - 10**9
    return [
        *plait_requests(0, 40, base_ns),
        *plait_requests(1, 40, base_ns),
        mixed_request(base_ns),
    ]


def test_decoded_spans_survive_the_trip_between_processes(requests: list[bytes]) -> None:
    parse = trace_request_parser()
    decoded = [decode_resources(parse(data).resources, StaticsCache()) for data in requests]
    kinds = {r.kind for request in decoded for resource in request for r in resource.records}
    assert kinds == {"step", "phase", "comm", "expert_load", "job_end"}
    rejected = [resource for resource in decoded[-1] if resource.rejected is not None]
    assert len(rejected) == 1 and decoded[-1][0].span_rejects
    for data, request in zip(requests, decoded, strict=True):
        # A worker decodes into fields and writes bytes; the daemon reads records back.
        for_wire = decode_resources(parse(data).resources, StaticsCache(), for_wire=True)
        assert [comparable(r) for r in decode_wire(encode_resources(for_wire))] == [
            comparable(r) for r in request
        ]


def comparable(resource: DecodedResource) -> tuple[object, ...]:
    """Everything a decoded resource holds (exceptions compare by identity: by their text)."""

    def why(error: Rejected | None) -> object:
        return None if error is None else (type(error), error.attribute, error.reason, str(error))

    return (
        resource.index,
        resource.attributes,
        resource.span_count,
        resource.identity,
        why(resource.rejected),
        resource.records,
        [(why(r.error), r.scope_index, r.span_index) for r in resource.span_rejects],
    )


@pytest.fixture(scope="module")
def daemons() -> Iterator[tuple[DaemonServer, DaemonServer]]:
    """A daemon that decodes every trace request itself, and one whose two workers do."""
    plain = DaemonServer("127.0.0.1:0", prometheus="127.0.0.1:0").start()
    pooled = DaemonServer(
        "127.0.0.1:0", prometheus="127.0.0.1:0", ingest_workers=2, ingest_offload_bytes=0
    ).start()
    try:
        yield plain, pooled
    finally:
        pooled.stop(grace=0.5)
        plain.stop(grace=0.5)


def export(server: DaemonServer, data: bytes) -> trace_service_pb2.ExportTraceServiceResponse:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=None,
            response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString,
        )
        return call(data, timeout=30)


def status(server: DaemonServer) -> daemon_pb2.StatusResponse:
    with grpc.insecure_channel(server.address) as channel:
        return daemon_pb2_grpc.DaemonStub(channel).Status(daemon_pb2.StatusRequest(), timeout=10)


def test_workers_store_what_the_daemon_stores(
    daemons: tuple[DaemonServer, DaemonServer], requests: list[bytes]
) -> None:
    plain, pooled = daemons
    for data in requests:
        assert export(pooled, data) == export(plain, data)  # partial successes included
    ours, theirs = probe(pooled), probe(plain)
    assert ours.figures(JOB) == theirs.figures(JOB)
    assert ours.figures(JOB)[0]  # the job's ranks are there
    for field in ("spans_received", "spans_ignored", "spans_rejected", "rejected_by_reason"):
        assert getattr(ours.status, field) == getattr(theirs.status, field), field
    assert dict(ours.status.rejected_by_reason) == {
        "plait.step: wrong type": 1,
        "plait.world_size: out of range": 4,
    }
    assert (ours.status.ingest_workers, theirs.status.ingest_workers) == (2, 0)
    assert ours.status.ingest_worker_requests == len(requests)
    assert theirs.status.ingest_worker_requests == 0


def test_status_shows_the_workers(
    daemons: tuple[DaemonServer, DaemonServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(daemon_commands, "console", Console(width=300))
    shown = CliRunner().invoke(app, ["status", "--host", daemons[1].address])
    assert shown.exit_code == 0, shown.output
    assert re.search(r"2 workers, \d+ requests", shown.output), shown.output


def test_a_malformed_request_is_refused_and_counted(
    daemons: tuple[DaemonServer, DaemonServer], requests: list[bytes]
) -> None:
    _, pooled = daemons
    before = status(pooled)
    with pytest.raises(grpc.RpcError) as refused:
        export(pooled, b"\x0a\xff\xff\xff\x0f" + b"\x00" * 64)  # a field longer than the request
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in (refused.value.details() or "")
    after = status(pooled)
    assert after.calls_rejected_by_reason["malformed"] == (
        before.calls_rejected_by_reason["malformed"] + 1
    )
    assert after.ingest_worker_restarts == before.ingest_worker_restarts
    export(pooled, requests[0])
    assert status(pooled).spans_received > after.spans_received


def test_a_killed_worker_loses_no_request() -> None:
    base_ns = time.time_ns() - 10**9
    batches = plait_requests(0, 20, base_ns)
    server = DaemonServer("127.0.0.1:0", ingest_workers=2, ingest_offload_bytes=0).start()
    try:
        pool = server.ingest_pool
        assert pool is not None
        for worker in list(pool._all):
            os.kill(worker.process.pid, signal.SIGKILL)
            worker.process.join(10)
        sent = 0
        for data in batches:
            assert not export(server, data).HasField("partial_success")
            sent += sum(
                len(scope.spans)
                for resource in trace_service_pb2.ExportTraceServiceRequest.FromString(
                    data
                ).resource_spans
                for scope in resource.scope_spans
            )
        after = status(server)
        assert len(batches) >= 3 and after.spans_received == sent
        assert after.ingest_worker_restarts == 2
        assert after.ingest_workers == 2
        # The replacements decode again: every request after the first two went to a worker.
        assert after.ingest_worker_requests == len(batches) - 2
    finally:
        server.stop(grace=0.5)


def test_workers_that_cannot_be_replaced_leave_decoding_to_the_daemon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batches = plait_requests(0, 20, time.time_ns() - 10**9)
    server = DaemonServer("127.0.0.1:0", ingest_workers=1, ingest_offload_bytes=0).start()
    try:
        pool = server.ingest_pool
        assert pool is not None
        (worker,) = pool._all
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.join(10)

        def never_ready(fresh: object) -> None:
            raise RuntimeError("an ingest worker did not start")

        monkeypatch.setattr(pool, "_wait_ready", never_ready)
        for data in batches:
            assert not export(server, data).HasField("partial_success")
        after = status(server)
        assert (after.ingest_workers, after.ingest_worker_restarts) == (0, 1)
        assert after.ingest_worker_requests == 0 and after.spans_received > 0
        assert not pool.takes(batches[0])  # no request waits for a worker that never comes
    finally:
        server.stop(grace=0.5)


def test_small_requests_stay_in_the_daemon() -> None:
    base_ns = time.time_ns() - 10**9
    small = trace_request(rank_resource(JOB, 0), step_spans(0, 2, base_ns)).SerializeToString()
    (large, *_) = plait_requests(0, 40, base_ns)
    server = DaemonServer("127.0.0.1:0", ingest_workers=1, ingest_offload_bytes=8192).start()
    try:
        assert len(small) < 8192 <= len(large)
        export(server, small)
        assert status(server).ingest_worker_requests == 0
        export(server, large)
        assert status(server).ingest_worker_requests == 1
    finally:
        server.stop(grace=0.5)


def test_the_daemon_refuses_a_negative_worker_count() -> None:
    with pytest.raises(ValueError, match="ingest_workers must be >= 0"):
        DaemonServer("127.0.0.1:0", ingest_workers=-1)


def test_the_cost_bench_times_every_stage() -> None:
    requests = encoded_rank_requests(0, 2, steps=10)
    costs = one_round(requests, trace_request_parser(), StaticsCache())
    assert set(costs) == set(STAGES) and all(seconds > 0 for seconds in costs.values())
