"""The daemon's memory: a bounded rolling window of spans, steps and metrics per rank.

A rank is identified by (job id, replica group, rank) from the OpenTelemetry resource it exports
with (the replica group is -1 outside fault-tolerant jobs, whose groups are worlds of their own
sharing the job id). Each
rank keeps its last `window_spans` spans, its last `window_steps` step records and the latest
value of every metric it sent; older data falls off. All access goes through one lock, since
the OTLP receivers and the query RPCs run on the gRPC server's thread pool.

Phase and comm spans are also indexed by step (`RankWindow.step_spans`) for the bottleneck
analysis, each rank's last comm heartbeat is kept for the hang detector, expert-load spans by
step, and a rank's end-of-run span as its outcome. A fault-tolerant job's quorum events go to
its `QuorumLog` (`plait.daemon.quorum_log`), a job's checkpoint saves to its `CheckpointLog`
(`plait.daemon.checkpoint_log`).

**Worlds.** Each job — each replica group of a fault-tolerant job — keeps the history of its
worlds (`JobWorlds`): a rank that appears with
another world size than the current world's, or with a restart attempt above any seen in the job
(torchrun's restart count), starts a new world; the ranks of the old world are then superseded.
A rank belongs to the current world when it has its world size and has been heard from since the
world started (`JobWorlds.is_member`). Which members are live, stale or ended is decided by the
analysis (`plait.daemon.analysis`), which knows the time.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from plait.daemon.bottleneck import StepBreakdown, StepSpan, step_breakdown
from plait.daemon.checkpoint_log import CheckpointLog, CheckpointSaveRecord
from plait.daemon.decoder import (
    ExpertLoadFigures,
    RankIdentity,
    RankKey,
    RejectCounts,
    Rejected,
    SpanRecord,
)
from plait.daemon.hangs import Heartbeat
from plait.daemon.mfu import StepSample
from plait.daemon.quorum_log import QuorumEventRecord, QuorumLog

DEFAULT_WINDOW_STEPS = 512
DEFAULT_WINDOW_SPANS = 50_000
MAX_WORLDS_KEPT = 32  # per job; older worlds are only counted

__all__ = [
    "JobWorlds",
    "RankIdentity",
    "RankKey",
    "RankWindow",
    "SpanRecord",
    "StepRecord",
    "TelemetryStore",
    "World",
]
Resource = RankIdentity | Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    start_ns: int
    end_ns: int
    tokens: int
    model_flops: float
    data_wait_seconds: float
    loss: float

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def union_seconds(intervals: Iterable[tuple[int, int]]) -> float:
    """Length of the union of [start, end) nanosecond intervals, in seconds."""
    total, current_start, current_end = 0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start  # type: ignore[operator]
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start  # type: ignore[operator]
    return total / 1e9


@dataclass(slots=True)
class _StepAnalysis:
    """A step's figures, with the spans (list and length) and step record they came from."""

    spans: list[StepSpan] | None
    count: int
    comm_seconds: float
    record: StepRecord | None = None
    breakdown: StepBreakdown | None = None


@dataclass
class RankWindow:
    """The rolling window of one rank."""

    identity: RankIdentity
    window_steps: int
    window_spans: int
    spans: deque[SpanRecord] = field(init=False)
    steps: OrderedDict[int, StepRecord] = field(default_factory=OrderedDict)
    step_spans: OrderedDict[int, list[StepSpan]] = field(default_factory=OrderedDict)
    step_spans_kept: int = 0  # entries in `step_spans`, at most `window_spans`
    metrics: dict[str, float] = field(default_factory=dict)
    heartbeat: Heartbeat | None = None
    spans_received: int = 0
    steps_received: int = 0
    # Bytes sent inside the node and across nodes since the daemon first heard the rank
    # (backend-carried comm spans: plait.daemon.decoder.CommFigures.on_the_wire).
    comm_bytes_intra_node_total: int = 0
    comm_bytes_inter_node_total: int = 0
    last_seen_ns: int = 0
    first_seen_ns: int = 0
    first_step: int | None = None  # the first step this rank reported (wire numbering)
    outcome: str = ""  # "finished" / "failed" once the rank said its run ended
    # step -> layer -> the step's expert load (whole job), the last window_steps steps.
    expert_loads: OrderedDict[int, dict[str, ExpertLoadFigures]] = field(
        default_factory=OrderedDict
    )
    # step -> what the analysis computed from its spans, while they are unchanged.
    _analysed: dict[int, _StepAnalysis] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.spans = deque(maxlen=self.window_spans)

    def add_span(self, span: SpanRecord) -> None:
        self.spans.append(span)
        self.spans_received += 1
        if span.step_figures is not None and span.step is not None:
            figures = span.step_figures
            self.steps[span.step] = StepRecord(
                step=span.step,
                start_ns=span.start_ns,
                end_ns=span.end_ns,
                tokens=figures.tokens,
                model_flops=figures.model_flops,
                data_wait_seconds=figures.data_wait_seconds,
                loss=figures.loss,
            )
            self.steps.move_to_end(span.step)
            self.steps_received += 1
            if self.first_step is None or span.step < self.first_step:
                self.first_step = span.step
            while len(self.steps) > self.window_steps:
                old_step, _ = self.steps.popitem(last=False)
                if old_step not in self.step_spans:
                    self._analysed.pop(old_step, None)
        elif span.kind in ("comm", "phase") and span.step is not None:
            comm = span.comm
            if comm is not None and comm.on_the_wire:
                self.comm_bytes_intra_node_total += comm.bytes_intra_node
                self.comm_bytes_inter_node_total += comm.bytes_inter_node
            if comm is not None:
                step_span = StepSpan(
                    kind="comm",
                    name=comm.op,
                    start_ns=span.start_ns,
                    end_ns=span.end_ns,
                    purpose=comm.purpose,
                    blocking=comm.blocking,
                    nbytes=comm.nbytes,
                    intra_node=comm.bytes_intra_node if comm.on_the_wire else 0,
                    inter_node=comm.bytes_inter_node if comm.on_the_wire else 0,
                )
            else:
                step_span = StepSpan(
                    kind="phase",
                    name=span.phase or span.name,
                    start_ns=span.start_ns,
                    end_ns=span.end_ns,
                )
            self.step_spans.setdefault(span.step, []).append(step_span)
            self.step_spans_kept += 1
            # Spans may arrive before their step span: keep twice the window of steps, and at
            # most `window_spans` spans in all (a producer that sends the same steps again and
            # again must not grow a step's list without bound).
            while len(self.step_spans) > 2 * self.window_steps or (
                self.step_spans_kept > self.window_spans and len(self.step_spans) > 1
            ):
                step, dropped = self.step_spans.popitem(last=False)
                self.step_spans_kept -= len(dropped)
                self._analysed.pop(step, None)
        elif span.expert_load is not None and span.step is not None:
            self.expert_loads.setdefault(span.step, {})[span.expert_load.layer] = span.expert_load
            while len(self.expert_loads) > self.window_steps:
                self.expert_loads.popitem(last=False)
        elif span.outcome:
            self.outcome = span.outcome

    def last_steps(self, count: int) -> list[StepRecord]:
        """The last `count` step records, oldest first (0: the whole window).

        NOTE: every query asks this of every rank several times, under the store's lock: walk
        back over `count` records rather than copying the window (512 by default) to slice it."""
        steps = self.steps
        if count <= 0 or count >= len(steps):
            return list(steps.values())
        records = list(islice(reversed(steps.values()), count))
        records.reverse()
        return records

    def samples(self, count: int) -> list[StepSample]:
        return [
            StepSample(
                step=r.step,
                seconds=r.seconds,
                model_flops=r.model_flops,
                tokens=r.tokens,
                world_size=self.identity.world_size,
            )
            for r in self.last_steps(count)
        ]

    def _analysed_spans(self, step: int) -> _StepAnalysis:
        """What the analysis computed from `step`'s spans, computed again only when one arrived
        since (a step's spans are only ever appended; a trimmed step's list is a new list)."""
        spans = self.step_spans.get(step)
        count = len(spans) if spans is not None else 0
        cached = self._analysed.get(step)
        if cached is None or cached.spans is not spans or cached.count != count:
            comm = union_seconds((s.start_ns, s.end_ns) for s in spans or () if s.kind == "comm")
            cached = _StepAnalysis(spans, count, comm)
            self._analysed[step] = cached
        return cached

    def comm_seconds(self, step: int) -> float:
        """Time during which a collective of `step` was running, overlapped or not."""
        return self._analysed_spans(step).comm_seconds

    def breakdown(self, record: StepRecord) -> StepBreakdown:
        analysed = self._analysed_spans(record.step)
        if analysed.record is not record:  # first asked, or the step span came again
            spans = analysed.spans or ()
            analysed.breakdown = step_breakdown(record.step, record.start_ns, record.end_ns, spans)
            analysed.record = record
        return analysed.breakdown  # type: ignore[return-value]

    def breakdowns(self, count: int) -> list[StepBreakdown]:
        """The bottleneck breakdown of each of the last `count` steps (0: the whole window)."""
        return [self.breakdown(r) for r in self.last_steps(count)]

    def comm_volume(self, count: int) -> dict[str, tuple[int, int]]:
        """purpose -> (collectives per step, mean bytes per collective) over the last steps."""
        steps = self.last_steps(count)
        ops: dict[str, list[int]] = {}
        for record in steps:
            for span in self.step_spans.get(record.step, ()):
                if span.kind == "comm":
                    ops.setdefault(span.purpose or "generic", []).append(span.nbytes)
        return {
            purpose: (round(len(sizes) / max(len(steps), 1)), sum(sizes) // len(sizes))
            for purpose, sizes in ops.items()
        }

    def comm_link_bytes(self, count: int) -> tuple[int, int]:
        """(inside the node, across nodes): bytes this rank sent per step, the mean over the
        last `count` steps (0: the whole window), in whole bytes (floor)."""
        steps = self.last_steps(count)
        intra = inter = 0
        for record in steps:
            for span in self.step_spans.get(record.step, ()):
                intra += span.intra_node
                inter += span.inter_node
        n = max(len(steps), 1)
        return intra // n, inter // n


@dataclass
class World:
    """One world of a job: its size, the restart attempt that formed it, when it started."""

    size: int
    attempt: int
    started_ns: int


@dataclass
class JobWorlds:
    """A job's worlds, oldest first (the last `MAX_WORLDS_KEPT`); `changes` counts them all."""

    worlds: list[World] = field(default_factory=list)
    max_attempt: int = 0
    changes: int = 0  # worlds started after the first one (restarts and resizes)

    @property
    def current(self) -> World:
        return self.worlds[-1]

    def observe(self, identity: RankIdentity, now_ns: int) -> None:
        """A rank appeared (first time, or with a new identity): does it start a new world?"""
        attempt = identity.restart_attempt
        if not self.worlds:
            self.worlds.append(World(identity.world_size, attempt, now_ns))
        elif identity.world_size != self.current.size or attempt > self.max_attempt:
            self.worlds.append(World(identity.world_size, attempt, now_ns))
            self.changes += 1
            del self.worlds[:-MAX_WORLDS_KEPT]
        self.max_attempt = max(self.max_attempt, attempt)

    def is_member(self, window: RankWindow) -> bool:
        """In the current world: its size, and heard from since the world started."""
        world = self.current
        return window.identity.world_size == world.size and window.last_seen_ns >= world.started_ns


def _identity(resource: Resource) -> RankIdentity | None:
    if isinstance(resource, RankIdentity):
        return resource
    return RankIdentity.from_resource(resource)


class TelemetryStore:
    """Every rank's window, behind one lock; the OTLP receivers write, the RPCs read."""

    def __init__(
        self,
        *,
        window_steps: int = DEFAULT_WINDOW_STEPS,
        window_spans: int = DEFAULT_WINDOW_SPANS,
    ) -> None:
        self.window_steps = window_steps
        self.window_spans = window_spans
        self.lock = threading.Lock()
        self._ranks: dict[RankKey, RankWindow] = {}
        self._jobs: dict[tuple[str, int], JobWorlds] = {}  # by (job id, replica group)
        self._quorum_logs: dict[str, QuorumLog] = {}
        self._checkpoint_logs: dict[str, CheckpointLog] = {}
        self.spans_received = 0
        self.spans_ignored = 0
        self.metric_points_received = 0
        self.spans_dropped = 0
        self.metric_points_dropped = 0
        self.rejected = RejectCounts()

    def _window(self, identity: RankIdentity) -> RankWindow:
        window = self._ranks.get(identity.key)
        now = time.time_ns()
        if window is None or window.identity != identity:
            # A restarted rank (new pid, new device) replaces its old window.
            window = RankWindow(identity, self.window_steps, self.window_spans)
            window.first_seen_ns = now
            self._ranks[identity.key] = window
            worlds = self._jobs.setdefault((identity.job_id, identity.replica_group), JobWorlds())
            worlds.observe(identity, now)
        window.last_seen_ns = now
        return window

    def worlds(self, job_id: str, replica_group: int = -1) -> JobWorlds:
        """The worlds of the job's replica group (-1: none) (call with `lock` held)."""
        return self._jobs[(job_id, replica_group)]

    def quorum_log(self, job_id: str) -> QuorumLog | None:
        """The job's quorum events, if it is fault tolerant (call with `lock` held)."""
        return self._quorum_logs.get(job_id)

    def checkpoint_log(self, job_id: str) -> CheckpointLog | None:
        """The job's last checkpoint saves, if it sent any (call with `lock` held)."""
        return self._checkpoint_logs.get(job_id)

    def _add_quorum_event(self, identity: RankIdentity, span: SpanRecord) -> None:
        assert span.quorum is not None
        log = self._quorum_logs.setdefault(identity.job_id, QuorumLog())
        log.add(
            QuorumEventRecord(
                identity.replica_group,
                span.quorum,
                span.step if span.step is not None else -1,
                span.start_ns,
                span.end_ns,
            )
        )

    def add_spans(self, resource: Resource, spans: Iterable[SpanRecord]) -> int:
        """Store spans exported with `resource`; returns how many were kept.

        `resource` is a decoded identity, or raw attributes (decoded here; `Rejected` if bad).
        """
        identity = _identity(resource)
        spans = list(spans)
        with self.lock:
            if identity is None:
                self.spans_ignored += len(spans)
                return 0
            window = self._window(identity)
            for span in spans:
                window.add_span(span)
                if span.quorum is not None:
                    self._add_quorum_event(identity, span)
                elif span.checkpoint is not None:
                    log = self._checkpoint_logs.setdefault(identity.job_id, CheckpointLog())
                    log.add(CheckpointSaveRecord(span.checkpoint, span.start_ns, span.end_ns))
            self.spans_received += len(spans)
        return len(spans)

    def add_metric_points(self, resource: Resource, points: Mapping[str, float]) -> None:
        identity = _identity(resource)
        if identity is None:
            return
        with self.lock:
            self._window(identity).metrics.update(points)
            self.metric_points_received += len(points)

    def set_heartbeat(self, resource: Resource, heartbeat: Heartbeat) -> None:
        identity = _identity(resource)
        if identity is None:
            return
        with self.lock:
            self._window(identity).heartbeat = heartbeat

    def heartbeats(self) -> dict[RankKey, Heartbeat | None]:
        with self.lock:
            return {key: w.heartbeat for key, w in self._ranks.items()}

    def count_rejected(self, rejected: Rejected, *, spans: int = 0, metric_points: int = 0) -> None:
        with self.lock:
            self.rejected.add(rejected, spans=spans, metric_points=metric_points)

    def count_ignored(self, spans: int) -> None:
        with self.lock:
            self.spans_ignored += spans

    def count_dropped(self, *, spans: int = 0, metric_points: int = 0) -> None:
        with self.lock:
            self.spans_dropped += spans
            self.metric_points_dropped += metric_points

    def windows(self, job_id: str = "") -> list[RankWindow]:
        """The rank windows of `job_id` (all jobs if empty), sorted by job and rank.

        Callers read the returned windows while holding `lock`.
        """
        return [w for key, w in sorted(self._ranks.items()) if not job_id or key[0] == job_id]

    def job_ids(self) -> list[str]:
        with self.lock:
            return sorted({job for job, _, _ in self._ranks})

    def local_pids(self, hostname: str) -> dict[RankKey, int]:
        """Pids of the ranks running on this host (the host collector samples them)."""
        with self.lock:
            return {
                key: w.identity.pid
                for key, w in self._ranks.items()
                if w.identity.host == hostname and w.identity.pid > 0
            }

    def spans_in(
        self, *, job_id: str, ranks: Iterable[int], start_ns: int, end_ns: int | None
    ) -> list[tuple[RankIdentity, SpanRecord]]:
        """Spans that start in [start_ns, end_ns) (end None: open), for a trace capture."""
        wanted = set(ranks)
        out: list[tuple[RankIdentity, SpanRecord]] = []
        with self.lock:
            for window in self.windows(job_id):
                if wanted and window.identity.rank not in wanted:
                    continue
                for span in window.spans:
                    if span.start_ns >= start_ns and (end_ns is None or span.start_ns < end_ns):
                        out.append((window.identity, span))
        return out
