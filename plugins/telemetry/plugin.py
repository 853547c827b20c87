"""The telemetry plugin: spans for every step, phase and communication op, and step metrics.

Hooks:

* `plait_configure` reads the daemon address (`telemetry.daemon`, else `$PLAIT_DAEMON`).
* `plait_job_start` builds the rank's OpenTelemetry providers (`plait.core.telemetry`), with the
  `JobInfo` as resource attributes; no daemon → one warning and every other hook is a no-op.
* `plait_communicate` (`wrapper=True`) records every op the comm facade issues: op, bytes,
  dtype, group name and ranks, sequence number, purpose, start and end.
* `plait_step_end` emits the step span, its phase spans (`StepReport.spans`, with their own
  nanosecond times) and the step's communication spans as children, then the step metrics.
* `plait_job_end` emits what is left, flushes and shuts the exporters down.

A comm heartbeat (`RankTelemetry.start_heartbeat`) reports, from the metric reader's thread,
the collectives this rank entered and has not finished and the last sequence number issued per
group, which is what the daemon's hang detector needs while a collective is blocked.

Spans are built at the end of the step rather than on the hot path: an op costs one small
record while the step runs, and every span of a step gets the step span as its parent.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from plait.core import telemetry_schema as names
from plait.core.comm import CompletedWork
from plait.core.hookspecs import hookimpl
from plait.core.telemetry import RankTelemetry, resolve_daemon_address
from plait.plugins.telemetry.comm_records import CommRecord, CudaAnchor, track_async_completion

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from plait.core.comm import Work
    from plait.core.config import PlaitConfig
    from plait.core.records import CommRequest
    from plait.core.step import JobInfo, StepReport

_PRIMITIVES = (str, bool, int, float)


def _attribute_value(value: Any) -> Any:
    if isinstance(value, _PRIMITIVES):
        return value
    if isinstance(value, list | tuple) and all(isinstance(v, _PRIMITIVES) for v in value):
        return list(value)
    return str(value)


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


def _is_group_collective(op: str, purpose: str) -> bool:
    """Ops every rank of the group issues in the same order (what hang detection matches).

    Point-to-point ops pair two ranks, and an algorithm's sub-ops ("ring/grad_bucket") are
    numbered by the algorithm's own facade, so neither follows the group's sequence.
    """
    return op not in ("send", "recv") and "/" not in purpose


class TelemetryPlugin:
    """Per-engine telemetry state; `plait.plugins.telemetry.make_plugin()` builds one."""

    def __init__(self) -> None:
        self.configured_address = ""
        self.telemetry: RankTelemetry | None = None
        self.step: int | None = None
        self.records: list[CommRecord] = []
        self._cuda_anchor: CudaAnchor | None = None
        self._uses_cuda = False
        # Last sequence number issued per (group name, ranks), collectives only.
        self.entered: dict[tuple[str, tuple[int, ...]], int] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    @hookimpl
    def plait_configure(self, config: PlaitConfig) -> None:
        self.configured_address = config.telemetry.daemon

    @hookimpl
    def plait_job_start(self, info: JobInfo) -> None:
        if self.telemetry is not None:
            return
        self._uses_cuda = info.device.startswith("cuda")
        self.telemetry = RankTelemetry.start(info, resolve_daemon_address(self.configured_address))
        if self.telemetry is not None:
            self.telemetry.start_heartbeat(self.comm_in_flight)

    def comm_in_flight(self) -> tuple[list[CommRecord], dict[tuple[str, tuple[int, ...]], int]]:
        """Collectives issued and not finished, and the last seq per group (heartbeat thread)."""
        records = list(self.records)  # the training thread may swap the list meanwhile
        inflight = [r for r in records if r.end_ns == 0 and _is_group_collective(r.op, r.purpose)]
        return inflight, dict(self.entered)

    @hookimpl
    def plait_step_start(self, step: int) -> None:
        self.step = step
        if self.telemetry is not None and self._uses_cuda:
            self._cuda_anchor = CudaAnchor.now()

    @hookimpl
    def plait_step_end(self, report: StepReport) -> None:
        telemetry = self.telemetry
        self.step = None
        if telemetry is None:
            return
        end_ns = report.end_ns or time.time_ns()
        start_ns = report.start_ns or end_ns - int(report.step_seconds * 1e9)
        grad_norm = report.grad_norm if report.grad_norm is not None else -1.0
        step_span = telemetry.tracer.start_span(
            names.STEP_SPAN_NAME,
            start_time=start_ns,
            attributes={
                names.SPAN_STEP: report.step,
                names.SPAN_STEP_TOKENS: report.tokens,
                names.SPAN_STEP_MODEL_FLOPS: float(report.model_flops),
                names.SPAN_STEP_DATA_WAIT: report.data_wait_seconds,
                names.SPAN_STEP_LOSS: report.loss,
                names.SPAN_STEP_LR: report.lr,
                names.SPAN_STEP_GRAD_NORM: grad_norm,
                names.SPAN_STEP_SKIPPED: report.skipped,
            },
        )
        parent = trace.set_span_in_context(step_span)
        tracer = telemetry.tracer
        for phase in report.spans:
            attributes: dict[str, Any] = {
                names.SPAN_STEP: report.step,
                names.SPAN_PHASE: phase.name,
            }
            if phase.microbatch is not None:
                attributes[names.SPAN_MICROBATCH] = phase.microbatch
            if phase.chunk is not None:
                attributes[names.SPAN_CHUNK] = phase.chunk
            for key, value in phase.attributes.items():
                attributes[names.SPAN_PHASE_ATTRIBUTE_PREFIX + key] = _attribute_value(value)
            span = tracer.start_span(
                phase.name, context=parent, start_time=phase.start_ns, attributes=attributes
            )
            span.end(end_time=phase.end_ns)
        self._emit_comm_records(parent_by_step={report.step: parent})
        step_span.end(end_time=end_ns)

        telemetry.tokens.add(report.tokens)
        telemetry.model_flops.add(float(report.model_flops))
        telemetry.step_duration.record(report.step_seconds)
        telemetry.data_wait.record(report.data_wait_seconds)
        telemetry.loss.set(report.loss)

    @hookimpl
    def plait_job_end(self) -> None:
        telemetry, self.telemetry = self.telemetry, None
        if telemetry is None:
            return
        if self._uses_cuda:
            import torch

            # Once, at shutdown: lets the last step's CUDA events be read.
            torch.cuda.synchronize()
        self._emit_comm_records(parent_by_step={}, telemetry=telemetry, final=True)
        telemetry.flush()
        telemetry.shutdown()

    # -- communication --------------------------------------------------------------------------

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: CommRequest) -> Generator[None, Work, Work]:
        if self.telemetry is None:
            return (yield)
        record = CommRecord.begin(request, self.step)
        if _is_group_collective(request.op, request.purpose):
            self.entered[(request.group_name, request.group_ranks)] = request.seq
        if self._uses_cuda and request.tensors and request.tensors[0].is_cuda:
            if self._cuda_anchor is None:
                self._cuda_anchor = CudaAnchor.now()
            record.start_cuda(self._cuda_anchor)
        self.records.append(record)
        try:
            work = yield
        except BaseException as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            record.finish()
            raise
        if request.async_op and not isinstance(work, CompletedWork):
            return track_async_completion(work, record)
        record.finish()
        return work

    def _emit_comm_records(
        self,
        *,
        parent_by_step: Mapping[int | None, Context],
        telemetry: RankTelemetry | None = None,
        final: bool = False,
    ) -> None:
        """Turn finished records into spans; unfinished ones wait for a later step."""
        telemetry = telemetry or self.telemetry
        assert telemetry is not None
        records, self.records = self.records, []
        keep: list[CommRecord] = []
        for record in records:
            if not (record.resolve_cuda() and record.done):
                if not final:
                    keep.append(record)
                    continue
                record.finish()  # never completed: report it as open until shutdown
                record.error = record.error or "not completed when the job ended"
            span = telemetry.tracer.start_span(
                record.op,
                context=parent_by_step.get(record.step),
                start_time=record.start_ns,
                attributes=comm_attributes(record),
            )
            if record.error:
                span.set_status(Status(StatusCode.ERROR, record.error))
            span.end(end_time=record.end_ns)
        if keep:
            self.records[:0] = keep
