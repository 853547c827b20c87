"""The span exporter: the training thread queues records, a background thread does the rest.

What the training thread pays per step is two `deque.append`s of tuples holding records that
are already immutable: `(STEP, report)` — the engine's frozen `StepReport` with its phase spans
— and `(COMM, records)` — the step's finished comm records, which nothing mutates once done.
What other features published (`(PUBLISHED, …)`: `plait.core.span_board` sources, a MoE model's
expert load with its counts possibly still on the device, a fault-tolerant group's quorum events)
is asked for its spans on the exporter thread; the end of the run (`(JOB_END, …)`) is queued with
the time it was queued.
Everything else happens on the exporter thread: span ids, attributes, OTLP protobuf bytes
(`plait.plugins.telemetry.otlp_wire`), batching (up to `max_batch` spans per request, at least
every `batch_delay` seconds), sending, the step metrics (`on_step`), and waiting for phases
timed with device events to complete (`plait.core.phase_timing`).

Telemetry never stalls training: if the exporter falls `max_queue` records behind (a daemon
answering slowly), new records are dropped and counted in `dropped`.

Each time it wakes, after sending, the thread calls `on_tick`: the control channel polls the
daemon from here (`plait.plugins.telemetry.control_client`), never from the training thread.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from plait.core.phase_timing import DEVICE_TIMING, DeviceInterval, device_interval
from plait.core.span_board import SpanSource
from plait.core.step import PhaseSpan, StepReport
from plait.daemon import telemetry_schema as names
from plait.plugins.telemetry import otlp_spans, otlp_wire
from plait.plugins.telemetry.comm_records import CommRecord

STEP, COMM, PUBLISHED, JOB_END = 0, 1, 2, 3
# An exporter still running at interpreter exit (its engine never closed) sends what is queued
# and stops first: on a GPU its thread reads device events in torch's C++ with the GIL
# released, and a daemon thread caught there when Python finalizes aborts the process.
EXIT_FLUSH_SECONDS = 10.0
BATCH_DELAY_SECONDS = 0.5
MAX_BATCH_SPANS = 4096
MAX_QUEUE_RECORDS = 65536
REMEMBERED_STEPS = 1024  # steps whose span ids late comm records can still name as parent

Send = Callable[[bytes], None]  # one serialized ExportTraceServiceRequest
logger = logging.getLogger(__name__)


class SpanExporter:
    """Turns queued step and comm records into OTLP spans on its own thread."""

    def __init__(
        self,
        *,
        send: Send,
        resource: Mapping[str, Any],
        scope: tuple[str, str],
        on_step: Callable[[StepReport], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        device: str = "cpu",
        batch_delay: float = BATCH_DELAY_SECONDS,
        max_batch: int = MAX_BATCH_SPANS,
        max_queue: int = MAX_QUEUE_RECORDS,
    ) -> None:
        self._send = send
        self._resource = otlp_wire.resource_attributes(resource)
        self._scope = otlp_wire.scope(*scope)
        self._encoder = otlp_wire.AttributeEncoder()
        self._on_step = on_step
        # Called on this thread each time it wakes (the control channel polls from here).
        self.on_tick = on_tick
        self._device = device
        self.batch_delay, self.max_batch, self.max_queue = batch_delay, max_batch, max_queue
        self._queue: deque[tuple[int, Any]] = deque()
        self._parents: OrderedDict[int, tuple[bytes, bytes]] = OrderedDict()
        self._pending: list[tuple[bytes, bytes, int, PhaseSpan, DeviceInterval]] = []
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._flush_requested = self._flush_done = 0
        self._stopping = False
        self.dropped = 0
        self.failed_sources = 0  # published sources whose spans could not be built
        self.spans_sent = 0
        self._thread = threading.Thread(target=self._run, name="plait-span-export", daemon=True)
        self._thread.start()
        _stop_at_exit(self)

    # -- the training thread ---------------------------------------------------------------------

    def put_step(self, report: StepReport) -> None:
        if len(self._queue) >= self.max_queue:
            self.dropped += 1
            return
        self._queue.append((STEP, report))

    def put_comm(self, records: Sequence[CommRecord]) -> None:
        if not records:
            return
        if len(self._queue) >= self.max_queue:
            self.dropped += len(records)
            return
        self._queue.append((COMM, records))

    def put_published(self, source: SpanSource, step: int) -> None:
        """A feature's published spans, resolved on the exporter thread (`step`: the step the
        telemetry was at when it took them). Dropped when the queue is full unless the source
        is `always_sent`."""
        if not source.always_sent and len(self._queue) >= self.max_queue:
            self.dropped += 1
            return
        self._queue.append((PUBLISHED, (source, step)))

    def put_job_end(self, outcome: str, last_step: int = -1) -> None:
        """The end-of-run span, sent after every span queued before it. Never dropped: it is
        what tells the daemon the run finished."""
        self._queue.append((JOB_END, (outcome, last_step, time.time_ns())))

    # -- any thread ------------------------------------------------------------------------------

    def flush(self, timeout: float) -> bool:
        """Export everything queued before this call; False if that took over `timeout`."""
        with self._cond:
            self._flush_requested += 1
            target = self._flush_requested
        self._wake.set()
        with self._cond:
            return self._cond.wait_for(lambda: self._flush_done >= target, timeout)

    def shutdown(self, timeout: float) -> None:
        """Export what is queued (phases still on the device with their host times), stop."""
        self._stopping = True
        self.flush(timeout)
        self._thread.join(timeout)

    # -- the exporter thread ---------------------------------------------------------------------

    def _run(self) -> None:
        if self._device.startswith("cuda"):
            import torch

            torch.cuda.set_device(self._device)  # device events are read on their device
        while True:
            self._wake.wait(self.batch_delay)
            self._wake.clear()
            with self._cond:
                target = self._flush_requested
            stopping = self._stopping
            try:
                self._drain(final=stopping)
            except Exception:  # never let one bad record end the exporter
                logger.exception("plait telemetry: building spans failed; records dropped")
            with self._cond:
                self._flush_done = target
                self._cond.notify_all()
            if stopping:
                return
            self._tick()

    def _tick(self) -> None:
        on_tick = self.on_tick
        if on_tick is None:
            return
        try:
            on_tick()
        except Exception:  # the control channel never ends the exporter either
            logger.exception("plait telemetry: the control channel failed; it carries on")

    def _drain(self, *, final: bool) -> None:
        spans: list[bytes] = []
        ends: list[bytes] = []  # after the phases still waiting for the device, below
        while self._queue:
            kind, payload = self._queue.popleft()
            if kind == STEP:
                spans.extend(self._step_spans(payload))
                if self._on_step is not None:
                    self._on_step(payload)
            elif kind == COMM:
                spans.extend(self._comm_span(record) for record in payload)
            elif kind == PUBLISHED:
                spans.extend(self._published_spans(*payload))
            else:
                ends.append(self._job_end_span(*payload))
            if len(spans) >= self.max_batch:
                self._export(spans)
                spans = []
        spans.extend(self._ready_phases(final=final))
        spans.extend(ends)
        if spans:
            self._export(spans)

    def _export(self, spans: list[bytes]) -> None:
        for start in range(0, len(spans), self.max_batch):
            batch = spans[start : start + self.max_batch]
            self._send(otlp_wire.export_request(self._resource, self._scope, batch))
            self.spans_sent += len(batch)

    def _step_spans(self, report: StepReport) -> list[bytes]:
        trace_id, span_id = otlp_spans.new_trace_id(), otlp_spans.new_span_id()
        self._parents[report.step] = (trace_id, span_id)
        while len(self._parents) > REMEMBERED_STEPS:
            self._parents.popitem(last=False)
        spans = [
            self._encoder.span(
                names.STEP_SPAN_NAME,
                trace_id=trace_id,
                span_id=span_id,
                start_ns=report.start_ns,
                end_ns=report.end_ns,
                attributes=otlp_spans.step_attributes(report),
            )
        ]
        for phase in report.spans:
            interval = device_interval(phase)
            if interval is not None and not interval.ready():
                self._pending.append((trace_id, span_id, report.step, phase, interval))
                continue
            spans.append(self._phase_span(trace_id, span_id, report.step, phase, interval))
        return spans

    def _phase_span(
        self,
        trace_id: bytes,
        parent: bytes,
        step: int,
        phase: PhaseSpan,
        interval: DeviceInterval | None,
    ) -> bytes:
        start_ns, end_ns = interval.times() if interval is not None else (0, 0)
        encoder = self._encoder
        if not phase.attributes or (len(phase.attributes) == 1 and interval is not None):
            # No attributes of its own: the phase's encoding repeats from step to step.
            attributes = encoder.block(
                ("phase", phase.name, phase.microbatch, phase.chunk),
                lambda: otlp_spans.phase_attributes(-1, phase, skip=DEVICE_TIMING, step=False),
            ) + encoder.int_value(names.SPAN_STEP, step)
        else:
            attributes = encoder.attributes(
                otlp_spans.phase_attributes(step, phase, skip=DEVICE_TIMING)
            )
        return encoder.span(
            phase.name,
            trace_id=trace_id,
            span_id=otlp_spans.new_span_id(),
            parent_span_id=parent,
            start_ns=start_ns or phase.start_ns,
            end_ns=end_ns or phase.end_ns,
            attributes=attributes,
        )

    def _ready_phases(self, *, final: bool) -> list[bytes]:
        """Phases whose device events have completed (all of them, host-timed, when `final`)."""
        spans, waiting = [], []
        for trace_id, parent, step, phase, interval in self._pending:
            if interval.ready():
                spans.append(self._phase_span(trace_id, parent, step, phase, interval))
            elif final:
                spans.append(self._phase_span(trace_id, parent, step, phase, None))
            else:
                waiting.append((trace_id, parent, step, phase, interval))
        self._pending = waiting
        return spans

    def _comm_span(self, record: CommRecord) -> bytes:
        # A record of a step the exporter has not seen (or no step) starts its own trace.
        step = record.step if record.step is not None else -1
        trace_id, parent = self._parents.get(step, (b"", b""))
        encoder = self._encoder
        attributes = encoder.block(
            otlp_spans.comm_static_key(record),
            lambda: otlp_spans.comm_static_attributes(record),
        ) + encoder.int_value(names.SPAN_COMM_SEQ, record.seq)
        if record.step is not None:
            attributes += encoder.int_value(names.SPAN_STEP, record.step)
        return encoder.span(
            record.op,
            trace_id=trace_id or otlp_spans.new_trace_id(),
            span_id=otlp_spans.new_span_id(),
            parent_span_id=parent,
            start_ns=record.start_ns,
            end_ns=record.end_ns,
            attributes=attributes,
            error=record.error,
        )

    def _job_end_span(self, outcome: str, last_step: int, time_ns: int) -> bytes:
        return self._instant_span(
            names.JOB_END_SPAN_NAME, time_ns, otlp_spans.job_end_attributes(outcome, last_step)
        )

    def _published_spans(self, source: SpanSource, step: int) -> list[bytes]:
        """A feature's spans, each in a trace of its own. A source that fails to describe or
        encode its spans is counted and dropped (logged once): never the exporter, nor the
        records queued after it."""
        try:
            return [
                self._encoder.span(
                    span.name,
                    trace_id=otlp_spans.new_trace_id(),
                    span_id=otlp_spans.new_span_id(),
                    start_ns=span.start_ns,
                    end_ns=max(span.end_ns, span.start_ns),
                    attributes=dict(span.attributes),
                )
                for span in source.spans(step)
            ]
        except Exception:
            self.failed_sources += 1
            if self.failed_sources == 1:
                logger.warning(
                    "telemetry: a published span source (%s) failed; its spans are dropped",
                    type(source).__name__,
                    exc_info=True,
                )
            return []

    def _instant_span(self, name: str, time_ns: int, attributes: dict[str, Any]) -> bytes:
        """A record with no duration, in a trace of its own."""
        return self._encoder.span(
            name,
            trace_id=otlp_spans.new_trace_id(),
            span_id=otlp_spans.new_span_id(),
            start_ns=time_ns,
            end_ns=time_ns,
            attributes=attributes,
        )


_running: weakref.WeakSet[SpanExporter] = weakref.WeakSet()


def _stop_at_exit(exporter: SpanExporter) -> None:
    if not _running:
        atexit.unregister(_stop_exporters)
        atexit.register(_stop_exporters)
    _running.add(exporter)


def _stop_exporters() -> None:
    for exporter in list(_running):
        if exporter._thread.is_alive():
            exporter.shutdown(EXIT_FLUSH_SECONDS)
