"""The span exporter thread and device-timed phases (CUDA events faked on CPU)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from plait.core.executor import Executor
from plait.core.phase_timing import DEVICE_TIMING, PhaseTimer
from plait.core.schedule import Backward, Forward, OptimizerStep
from plait.core.step import PhaseSpan, StepReport
from plait.daemon import telemetry_schema as names
from plait.daemon.decoder import decode_span
from plait.daemon.otlp_requests import attributes
from plait.plugins.telemetry import exporter as exporter_module
from plait.plugins.telemetry.comm_records import CommRecord
from plait.plugins.telemetry.exporter import SpanExporter
from tests.daemon.fake_cuda import FakeCuda, FakeDevice


class Sink:
    """Collects what the exporter sends, and on which thread."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, request: bytes) -> None:
        self.gate.wait(60)
        self.threads.add(threading.current_thread().name)
        # The official classes must parse every byte the exporter writes.
        self.requests.append(ExportTraceServiceRequest.FromString(request))

    @property
    def spans(self) -> list[Span]:
        return [
            span
            for request in self.requests
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]


def report(step: int, phases: tuple[PhaseSpan, ...] = ()) -> StepReport:
    end = time.time_ns()
    return StepReport(
        step=step, loss=1.5, tokens=64, step_seconds=0.01, data_wait_seconds=0.001,
        model_flops=1e9, lr=1e-3, start_ns=end - 10_000_000, end_ns=end, spans=phases,
    )  # fmt: skip


def comm(step: int | None, seq: int) -> CommRecord:
    now = time.time_ns()
    return CommRecord(
        op="all_reduce", nbytes=1024, dtype=None, group_name="dp", group_ranks=(0, 1), seq=seq,
        purpose="grad_bucket", peer=None, async_op=True, step=step, start_ns=now,
        end_ns=now + 1000,
    )  # fmt: skip


def exporter(sink: Sink, **kwargs: Any) -> SpanExporter:
    return SpanExporter(
        send=sink, resource={"plait.job.id": "j", "plait.rank": 0}, scope=("t", "0"), **kwargs
    )


def test_spans_are_built_and_sent_off_the_training_thread() -> None:
    sink = Sink()
    sink.gate.clear()  # the daemon answers slowly
    steps: list[int] = []
    spans = exporter(sink, batch_delay=0.01, on_step=lambda r: steps.append(r.step))
    phases = (PhaseSpan(name="forward", start_ns=1, end_ns=2, microbatch=0),)

    def training() -> None:
        for step in range(50):
            spans.put_step(report(step, phases))
            spans.put_comm([comm(step, step)])

    # Queuing only, whatever the daemon does: the training thread finishes its 50 steps while
    # the daemon has not answered a single request (the sink is held shut until after).
    trainer = threading.Thread(target=training)
    trainer.start()
    trainer.join(timeout=30)
    assert not trainer.is_alive() and sink.requests == []
    sink.gate.set()
    assert spans.flush(10)
    spans.shutdown(5)
    assert sink.threads == {"plait-span-export"}
    assert steps == list(range(50))  # the step metrics are recorded by the exporter too
    by_name: dict[str, list[Span]] = {}
    for span in sink.spans:
        by_name.setdefault(span.name, []).append(span)
    assert {k: len(v) for k, v in by_name.items()} == {"step": 50, "forward": 50, "all_reduce": 50}
    step_ids = {span.span_id: span for span in by_name["step"]}
    for child in by_name["forward"] + by_name["all_reduce"]:
        parent = step_ids[child.parent_span_id]
        assert child.trace_id == parent.trace_id
        assert (
            attributes(child.attributes)[names.SPAN_STEP]
            == attributes(parent.attributes)[names.SPAN_STEP]
        )
    # What the exporter builds passes the daemon's door unchanged.
    for span in sink.spans:
        decode_span(
            span.name, span.start_time_unix_nano, span.end_time_unix_nano,
            attributes(span.attributes), span.status.code == Status.STATUS_CODE_ERROR,
        )  # fmt: skip


def test_a_comm_record_finished_steps_later_keeps_its_step_as_parent() -> None:
    sink = Sink()
    spans = exporter(sink, batch_delay=5.0)
    spans.put_step(report(3))
    spans.put_step(report(4))
    late = comm(3, 7)
    late.error = "RuntimeError: boom"
    spans.put_comm([late, comm(None, 8)])
    spans.shutdown(5)
    step3 = next(s for s in sink.spans if s.name == "step" and attributes(s.attributes)[
        names.SPAN_STEP] == 3)  # fmt: skip
    failed, outside = [s for s in sink.spans if s.name == "all_reduce"]
    assert failed.parent_span_id == step3.span_id and failed.trace_id == step3.trace_id
    assert failed.status.code == Status.STATUS_CODE_ERROR and "boom" in failed.status.message
    assert outside.parent_span_id == b"" and len(outside.trace_id) == 16


def test_a_full_queue_drops_and_counts_instead_of_growing() -> None:
    sink = Sink()
    spans = exporter(sink, batch_delay=5.0, max_queue=3)
    for step in range(5):
        spans.put_step(report(step))
    assert spans.dropped == 2
    spans.shutdown(5)
    assert len(sink.spans) == 3


# -- phases timed with device events --------------------------------------------------------------


def run_step_on_fake_gpu(device: FakeDevice) -> list[PhaseSpan]:
    """An executor step whose handlers only queue work, as CUDA launches do."""
    timer = PhaseTimer(FakeCuda(device))
    handlers = {
        Forward: lambda action: device.launch(30.0),
        Backward: lambda action: device.launch(60.0),
        OptimizerStep: lambda action: device.launch(10.0),
    }
    actions = [Forward(microbatch=0), Backward(microbatch=0), OptimizerStep()]
    return timer.attach(Executor(timer.wrap(handlers)).run(actions))


def test_phases_are_held_until_their_device_events_complete_then_carry_device_times() -> None:
    device = FakeDevice()
    phases = run_step_on_fake_gpu(device)
    assert [p.name for p in phases] == ["forward", "backward", "optimizer"]
    host = {p.name: (p.end_ns - p.start_ns) / 1e6 for p in phases}
    assert all(ms < 30 for ms in host.values())  # the host only queued the work
    assert device.events_recorded == 1 + 2 * 3  # anchor + a pair per action, nothing else

    sink = Sink()
    spans = exporter(sink, batch_delay=0.01)
    device.run(35.0)  # forward done, backward still running
    spans.put_step(report(0, tuple(phases)))
    assert spans.flush(5)
    sent = {s.name: s for s in sink.spans}
    assert set(sent) == {"step", "forward"}  # no waiting for the device on any thread
    device.run()
    assert spans.flush(5)
    spans.shutdown(5)
    sent = {s.name: s for s in sink.spans}
    assert set(sent) == {"step", "forward", "backward", "optimizer"}
    device_ms = {
        name: (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6 for name, s in sent.items()
    }
    assert device_ms["forward"] == pytest.approx(30.0)
    assert device_ms["backward"] == pytest.approx(60.0)
    assert device_ms["optimizer"] == pytest.approx(10.0)
    # back to back on the device, in order
    assert sent["backward"].start_time_unix_nano == sent["forward"].end_time_unix_nano
    assert all(DEVICE_TIMING not in attributes(s.attributes) for s in sink.spans)
    assert not any(k.endswith(DEVICE_TIMING) for s in sink.spans for k in attributes(s.attributes))


def test_phases_not_complete_at_shutdown_keep_their_host_times() -> None:
    device = FakeDevice()
    phases = run_step_on_fake_gpu(device)
    sink = Sink()
    spans = exporter(sink, batch_delay=5.0)
    spans.put_step(report(0, tuple(phases)))
    spans.shutdown(5)
    sent = {s.name: s for s in sink.spans}
    assert set(sent) == {"step", "forward", "backward", "optimizer"}
    assert sent["backward"].start_time_unix_nano == phases[1].start_ns


def test_no_timer_on_cpu() -> None:
    assert PhaseTimer.for_device("cpu") is None


def test_an_exporter_left_running_sends_its_queue_and_stops_at_interpreter_exit() -> None:
    sink = Sink()
    spans = exporter(sink, batch_delay=60.0)  # nothing is sent before the exit handler runs
    spans.put_step(report(3))
    (thread,) = [t for t in threading.enumerate() if t.name == "plait-span-export"]
    exporter_module._stop_exporters()  # what atexit runs
    assert not thread.is_alive()
    assert [span.name for span in sink.spans] == ["step"]
