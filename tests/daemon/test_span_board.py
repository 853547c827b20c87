"""The core's span board: what a feature publishes (a MoE model's expert load, a replica group's
quorum events) reaches the daemon through the telemetry plugin, which knows neither feature.

The board hands each source over once, oldest first, and forgets the oldest when nobody takes
them; the exporter sends a source's spans as the source described them, drops a step's worth of
records when it lags but never a source that must always be sent, and drops a source that fails
alone; and the plugin takes sources at both step boundaries, so counts published inside step N
are step N's."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from plait.core.config import load_config
from plait.core.plugins import Plugins
from plait.core.span_board import BOARD, PublishedSpan, SpanBoard
from plait.core.step import StepReport
from plait.daemon import telemetry_schema as names
from plait.daemon.otlp_requests import attributes
from plait.daemon.server import DaemonServer
from plait.plugins.expert_parallel.expert_load import publish_expert_load
from plait.plugins.telemetry import make_plugin
from plait.plugins.telemetry.exporter import SpanExporter
from tests.daemon.daemon_fakes import job_info


@dataclass(frozen=True)
class Marker:
    """A source of one span named by the test, with the step the telemetry gave it."""

    label: str
    always_sent: bool = False

    def spans(self, step: int) -> Sequence[PublishedSpan]:
        return [
            PublishedSpan(
                name="test.marker",
                start_ns=1_000,
                end_ns=500,  # before its start: sent as an instant, never negative
                attributes={"label": self.label, names.SPAN_STEP: step},
            )
        ]


def test_a_source_is_taken_once_oldest_first_and_the_oldest_fall_off() -> None:
    board = SpanBoard(capacity=2)
    first, second, third = Marker("a"), Marker("b"), Marker("c")
    for source in (first, second, third):
        board.publish(source)
    assert board.take() == [second, third]
    assert board.take() == []


def sent(requests: list[bytes]) -> list[tuple[str, int, int, dict]]:
    found = []
    for raw in requests:
        request = ExportTraceServiceRequest.FromString(raw)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    found.append(
                        (span.name, span.start_time_unix_nano, span.end_time_unix_nano,
                         attributes(span.attributes))
                    )  # fmt: skip
    return found


def test_the_exporter_sends_what_the_source_describes_and_drops_only_what_may_be_dropped() -> None:
    requests: list[bytes] = []
    exporter = SpanExporter(send=requests.append, resource={names.RESOURCE_JOB_ID: "j"},
                            scope=("t", "0"), batch_delay=3600.0, max_queue=1)  # fmt: skip
    exporter.put_published(Marker("queued"), 3)
    exporter.put_published(Marker("dropped"), 3)  # the queue is full
    exporter.put_published(Marker("kept", always_sent=True), 4)
    assert exporter.dropped == 1
    exporter.shutdown(30)
    assert sent(requests) == [
        ("test.marker", 1_000, 1_000, {"label": "queued", names.SPAN_STEP: 3}),
        ("test.marker", 1_000, 1_000, {"label": "kept", names.SPAN_STEP: 4}),
    ]


class Broken:
    """A source whose spans cannot be built (a bug in some feature's code)."""

    always_sent = True

    def spans(self, step: int) -> Sequence[PublishedSpan]:
        raise RuntimeError("no spans today")


def test_a_source_that_fails_is_dropped_alone() -> None:
    requests: list[bytes] = []
    exporter = SpanExporter(send=requests.append, resource={names.RESOURCE_JOB_ID: "j"},
                            scope=("t", "0"), batch_delay=3600.0)  # fmt: skip
    exporter.put_published(Broken(), 1)
    exporter.put_published(Marker("after"), 2)
    exporter.put_job_end(names.JOB_OUTCOME_FINISHED, last_step=2)
    exporter.shutdown(30)
    assert exporter.failed_sources == 1
    found = sent(requests)
    assert found[0] == ("test.marker", 1_000, 1_000, {"label": "after", names.SPAN_STEP: 2})
    assert found[-1][0] == names.JOB_END_SPAN_NAME


def report(step: int) -> StepReport:
    now = time.time_ns()
    return StepReport(step=step, loss=1.0, tokens=64, step_seconds=0.1, data_wait_seconds=0.0,
                      model_flops=1e9, lr=1e-3, start_ns=now, end_ns=now + 10**8)  # fmt: skip


def test_counts_published_inside_a_step_are_that_steps_at_the_daemon() -> None:
    BOARD.take()  # nothing left over from another test of this process
    with DaemonServer("127.0.0.1:0", host_interval=60.0) as server:
        plugins = Plugins.create(autoload=False, builtins=())
        plugins.register(make_plugin(), "telemetry")
        plugins.configure(load_config({"telemetry": {"daemon": server.address}}))
        plugins.job_start(job_info(rank=0, world_size=1, job_id="board"))
        plugins.step_start(5)
        # The expert-parallel runtime publishes after the optimizer step, inside the step.
        publish_expert_load(["moe.0"], torch.tensor([[5.0, 3.0]]), torch.tensor([1.0]))
        plugins.step_end(report(5))
        plugins.step_start(6)
        plugins.step_end(report(6))
        plugins.job_end()
        assert BOARD.take() == []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            windows = server.store.windows("board")
            if windows and windows[0].outcome:
                break
            time.sleep(0.05)
        (window,) = server.store.windows("board")
    assert window.outcome == "finished"
    assert {
        step: {name: (f.tokens_per_expert, f.dropped) for name, f in layers.items()}
        for step, layers in window.expert_loads.items()
    } == {5: {"moe.0": ((5, 3), 1)}}
