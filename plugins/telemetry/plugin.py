"""The telemetry plugin: spans for every step, phase and communication op, and step metrics.

Hooks:

* `plait_configure` reads the daemon address (`telemetry.daemon`, else `$PLAIT_DAEMON`).
* `plait_job_start` learns the job's nodes and their daemons (`job_nodes`, one all-gather)
  and builds the rank's telemetry (`rank_telemetry.RankTelemetry`): the span exporter thread
  and the metric providers, with the `JobInfo` as resource attributes; no daemon → one
  warning and every other hook is a no-op.
* `plait_communicate` (`wrapper=True`) records every op the comm facade issues: op, bytes,
  dtype, group name and ranks, sequence number, purpose, start and end, what carried it out
  and the bytes it sent inside and across nodes (`comm_links`, from the world's host map).
* `plait_step_end` queues the step's report (its phase spans inside) and its finished comm
  records to the exporter (`plait.plugins.telemetry.exporter`), which builds the step span, the
  phase spans and the comm spans as its children, sends them and records the step metrics,
  all off the training thread.
* At every step boundary (and at the end) what other features published on the core's span
  board (`plait.core.span_board`) is queued the same way: a MoE model's expert load (its
  counts still as published, read back on the exporter thread), a fault-tolerant group's
  joins, leaves, heals and failed commits. The features name their spans; this plugin only
  sends them.
* `plait_job_end` queues what is left and the end-of-run span, then shuts the exporters down.

The step hooks also tell the control channel where step boundaries are, so a profile
(`plait profile`) or memory capture (`plait memory`) the daemon asks for starts and stops on
them.

A comm heartbeat (`plait.plugins.telemetry.heartbeat`) reports, from the metric reader's thread,
the collectives this rank entered and has not finished and the last sequence number issued per
group, which is what the daemon's hang detector needs while a collective is blocked.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

from plait.core.comm import CompletedWork
from plait.core.hookspecs import hookimpl
from plait.core.host_map import known_host_map
from plait.core.span_board import BOARD as SPAN_BOARD
from plait.daemon.address import resolve_daemon_address
from plait.plugins.telemetry.comm_links import CommLinks
from plait.plugins.telemetry.comm_records import CommRecord, CudaAnchor, track_async_completion
from plait.plugins.telemetry.exporter import SpanExporter
from plait.plugins.telemetry.job_nodes import gather_job_nodes
from plait.plugins.telemetry.otlp_spans import comm_attributes
from plait.plugins.telemetry.rank_telemetry import RankTelemetry

if TYPE_CHECKING:
    from plait.core.comm import Work
    from plait.core.config import PlaitConfig
    from plait.core.records import CommRequest
    from plait.core.step import JobInfo, StepReport

__all__ = ["TelemetryPlugin", "comm_attributes"]


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
        self.exporter: SpanExporter | None = None
        self.step: int | None = None
        self.last_step = -1
        self.records: list[CommRecord] = []
        self._cuda_anchor: CudaAnchor | None = None
        self._uses_cuda = False
        # Last sequence number issued per (group name, ranks), collectives only.
        self.entered: dict[tuple[str, tuple[int, ...]], int] = {}
        # Host-timed async ops not yet waited on: each op issued asks them whether they are done.
        self._unwaited: list[CommRecord] = []
        self.links: CommLinks | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    @hookimpl
    def plait_configure(self, config: PlaitConfig) -> None:
        self.configured_address = config.telemetry.daemon

    @hookimpl
    def plait_job_start(self, info: JobInfo) -> None:
        if self.telemetry is not None:
            return
        self._uses_cuda = info.device.startswith("cuda")
        address = resolve_daemon_address(self.configured_address)
        # Collective, so before anything that may differ between ranks (a daemon one node
        # cannot reach): every rank learns where the job's daemons are.
        job_nodes = gather_job_nodes(address)
        self.links = CommLinks(info.rank, known_host_map())
        telemetry = RankTelemetry.start(info, address)
        if telemetry is None:
            return
        telemetry.control.job_nodes = job_nodes
        self.exporter = telemetry.spans
        self.telemetry = telemetry
        telemetry.start_heartbeat(self.comm_in_flight)

    def comm_in_flight(self) -> tuple[list[CommRecord], dict[tuple[str, tuple[int, ...]], int]]:
        """Collectives issued and not finished, and the last seq per group (heartbeat thread)."""
        records = list(self.records)  # the training thread may swap the list meanwhile
        inflight = [r for r in records if r.end_ns == 0 and _is_group_collective(r.op, r.purpose)]
        return inflight, dict(self.entered)

    @hookimpl
    def plait_step_start(self, step: int) -> None:
        self.step = step
        telemetry = self.telemetry
        if telemetry is None:
            return
        # Published after the last step ended (a fault-tolerant step's quorum events).
        # NOTE: inline, as the training thread's per-op budget counts this file's calls.
        for source in SPAN_BOARD.take():
            telemetry.spans.put_published(source, step)
        if self._uses_cuda:
            self._cuda_anchor = CudaAnchor.now()
        control = telemetry.control
        control.step = step  # where `plait stacks` says the rank is
        if control.armed:  # a profile or memory capture may start with this step
            control.step_started(step)

    @hookimpl
    def plait_step_end(self, report: StepReport) -> None:
        self.step = None
        exporter = self.exporter
        if exporter is None:
            return
        exporter.put_step(report)
        exporter.put_comm(self._finished_comm_records(final=False))
        telemetry = self.telemetry
        if telemetry is not None and telemetry.control.armed:
            telemetry.control.step_finished(report.step)  # after the step's spans are queued
        self.last_step = report.step
        # What features published during the step (a MoE model's expert load).
        for source in SPAN_BOARD.take():
            exporter.put_published(source, report.step)

    @hookimpl
    def plait_job_end(self) -> None:
        telemetry, exporter = self.telemetry, self.exporter
        self.telemetry = self.exporter = None
        if telemetry is None or exporter is None:
            return
        if self._uses_cuda:
            import torch

            # Once, at shutdown: lets the last step's CUDA events be read.
            torch.cuda.synchronize()
        exporter.put_comm(self._finished_comm_records(final=True))
        for source in SPAN_BOARD.take():  # the last step's, after its end
            exporter.put_published(source, self.last_step)
        telemetry.end_job(last_step=self.last_step)  # the daemon shows the job finished
        telemetry.shutdown()  # sends everything queued, the end of the run last

    # -- communication --------------------------------------------------------------------------

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: CommRequest) -> Generator[None, Work, Work]:
        if self.telemetry is None:
            return (yield)
        if self._unwaited:
            self._stamp_completed()
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
        if self.links is not None:
            self.links.note(request, record)
        if request.async_op and not isinstance(work, CompletedWork):
            if record.cuda_start is None:
                self._unwaited.append(record)
            return track_async_completion(work, record)
        record.finish()
        return work

    def _stamp_completed(self) -> None:
        """End the unwaited async ops whose work reports completion, at this op's issue: a DDP
        bucket's all-reduce that finished under backward ends by the next bucket's issue, not
        at the wait after backward (which would count the compute it hid under as its time).
        One `is_completed()` per op in flight, on this thread; no callback on the backend's."""
        still = []
        for record in self._unwaited:
            work = record.work
            if work is None:  # waited on meanwhile
                continue
            completed = getattr(work, "is_completed", None)
            if completed is not None and completed():
                record.finish()
            else:
                still.append(record)
        self._unwaited = still

    def _finished_comm_records(self, *, final: bool) -> list[CommRecord]:
        """Records that are done (device times read where timed on CUDA); the others wait for a
        later step. At the end of the job every record is finished, unfinished ones as errors."""
        records, self.records = self.records, []
        finished: list[CommRecord] = []
        keep: list[CommRecord] = []
        for record in records:
            if not (record.resolve_cuda() and record.done):
                if not final:
                    keep.append(record)
                    continue
                record.finish()  # never completed: report it as open until shutdown
                record.error = record.error or "not completed when the job ended"
            finished.append(record)
        if keep:
            self.records[:0] = keep
        return finished
