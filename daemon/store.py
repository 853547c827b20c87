"""The daemon's memory: a bounded rolling window of spans, steps and metrics per rank.

A rank is identified by (job id, rank) from the OpenTelemetry resource it exports with. Each
rank keeps its last `window_spans` spans, its last `window_steps` step records and the latest
value of every metric it sent; older data falls off. All access goes through one lock, since
the OTLP receivers and the query RPCs run on the gRPC server's thread pool.

Phase and comm spans are also indexed by step (`RankWindow.step_spans`) for the bottleneck
analysis, and each rank's last comm heartbeat is kept for the hang detector.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from plait.core import telemetry as names
from plait.daemon.bottleneck import StepBreakdown, StepSpan, step_breakdown
from plait.daemon.hangs import Heartbeat
from plait.daemon.mfu import StepSample

DEFAULT_WINDOW_STEPS = 512
DEFAULT_WINDOW_SPANS = 50_000

RankKey = tuple[str, int]  # (job id, rank)


@dataclass(frozen=True, slots=True)
class RankIdentity:
    """Who a rank is, from its resource attributes."""

    job_id: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    device: str
    device_name: str
    compute_dtype: str
    peak_flops: float
    peak_flops_source: str
    model_name: str
    num_params: int
    coordinates: dict[str, int]
    degrees: dict[str, int]

    @property
    def key(self) -> RankKey:
        return (self.job_id, self.rank)

    @classmethod
    def from_resource(cls, attributes: Mapping[str, Any]) -> RankIdentity | None:
        """`None` for a resource that is not a plait rank (no job id or rank attribute)."""
        if names.ATTR_RANK not in attributes or names.ATTR_JOB_ID not in attributes:
            return None

        def prefixed(prefix: str) -> dict[str, int]:
            return {k[len(prefix) :]: int(v) for k, v in attributes.items() if k.startswith(prefix)}

        return cls(
            job_id=str(attributes[names.ATTR_JOB_ID]),
            rank=int(attributes[names.ATTR_RANK]),
            local_rank=int(attributes.get(names.ATTR_LOCAL_RANK, 0)),
            world_size=int(attributes.get(names.ATTR_WORLD_SIZE, 1)),
            host=str(attributes.get("host.name", "")),
            pid=int(attributes.get("process.pid", 0)),
            device=str(attributes.get(names.ATTR_DEVICE, "")),
            device_name=str(attributes.get(names.ATTR_DEVICE_NAME, "")),
            compute_dtype=str(attributes.get(names.ATTR_COMPUTE_DTYPE, "")),
            peak_flops=float(attributes.get(names.ATTR_PEAK_FLOPS, 0.0)),
            peak_flops_source=str(attributes.get(names.ATTR_PEAK_FLOPS_SOURCE, "")),
            model_name=str(attributes.get(names.ATTR_MODEL_NAME, "")),
            num_params=int(attributes.get(names.ATTR_NUM_PARAMS, 0)),
            coordinates=prefixed(names.ATTR_MESH_COORD_PREFIX),
            degrees=prefixed(names.ATTR_MESH_DEGREE_PREFIX),
        )


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """One received span. `kind` is "step", "phase", "comm" or "other"."""

    name: str
    kind: str
    start_ns: int
    end_ns: int
    step: int | None
    attributes: dict[str, Any]
    error: bool = False

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @classmethod
    def classify(
        cls, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any], error: bool
    ) -> SpanRecord:
        if names.ATTR_COMM_OP in attributes:
            kind = "comm"
        elif names.ATTR_PHASE in attributes:
            kind = "phase"
        elif name == names.STEP_SPAN_NAME and names.ATTR_STEP_MODEL_FLOPS in attributes:
            kind = "step"
        else:
            kind = "other"
        step = attributes.get(names.ATTR_STEP)
        return cls(name, kind, start_ns, end_ns, int(step) if step is not None else None,
                   attributes, error)  # fmt: skip


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


@dataclass
class RankWindow:
    """The rolling window of one rank."""

    identity: RankIdentity
    window_steps: int
    window_spans: int
    spans: deque[SpanRecord] = field(init=False)
    steps: OrderedDict[int, StepRecord] = field(default_factory=OrderedDict)
    comm_intervals: OrderedDict[int, list[tuple[int, int]]] = field(default_factory=OrderedDict)
    step_spans: OrderedDict[int, list[StepSpan]] = field(default_factory=OrderedDict)
    metrics: dict[str, float] = field(default_factory=dict)
    heartbeat: Heartbeat | None = None
    spans_received: int = 0
    steps_received: int = 0
    last_seen_ns: int = 0

    def __post_init__(self) -> None:
        self.spans = deque(maxlen=self.window_spans)

    def add_span(self, span: SpanRecord) -> None:
        self.spans.append(span)
        self.spans_received += 1
        if span.kind == "step" and span.step is not None:
            a = span.attributes
            self.steps[span.step] = StepRecord(
                step=span.step,
                start_ns=span.start_ns,
                end_ns=span.end_ns,
                tokens=int(a.get(names.ATTR_STEP_TOKENS, 0)),
                model_flops=float(a.get(names.ATTR_STEP_MODEL_FLOPS, 0.0)),
                data_wait_seconds=float(a.get(names.ATTR_STEP_DATA_WAIT, 0.0)),
                loss=float(a.get(names.ATTR_STEP_LOSS, 0.0)),
            )
            self.steps.move_to_end(span.step)
            self.steps_received += 1
            while len(self.steps) > self.window_steps:
                self.steps.popitem(last=False)
        elif span.kind in ("comm", "phase") and span.step is not None:
            if span.kind == "comm":
                self.comm_intervals.setdefault(span.step, []).append((span.start_ns, span.end_ns))
            self.step_spans.setdefault(span.step, []).append(
                StepSpan.from_attributes(
                    span.kind, span.name, span.start_ns, span.end_ns, span.attributes
                )
            )
            # Spans may arrive before their step span; keep twice the window of steps.
            while len(self.comm_intervals) > 2 * self.window_steps:
                self.comm_intervals.popitem(last=False)
            while len(self.step_spans) > 2 * self.window_steps:
                self.step_spans.popitem(last=False)

    def last_steps(self, count: int) -> list[StepRecord]:
        records = list(self.steps.values())
        return records[-count:] if count > 0 else records

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

    def comm_seconds(self, step: int) -> float:
        return union_seconds(self.comm_intervals.get(step, ()))

    def breakdowns(self, count: int) -> list[StepBreakdown]:
        """The bottleneck breakdown of each of the last `count` steps (0: the whole window)."""
        return [
            step_breakdown(r.step, r.start_ns, r.end_ns, self.step_spans.get(r.step, ()))
            for r in self.last_steps(count)
        ]

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
        self.spans_received = 0
        self.spans_ignored = 0
        self.metric_points_received = 0
        self.spans_dropped = 0
        self.metric_points_dropped = 0

    def _window(self, identity: RankIdentity) -> RankWindow:
        window = self._ranks.get(identity.key)
        if window is None or window.identity != identity:
            # A restarted rank (new pid, new device) replaces its old window.
            window = RankWindow(identity, self.window_steps, self.window_spans)
            self._ranks[identity.key] = window
        window.last_seen_ns = time.time_ns()
        return window

    def add_spans(self, resource: Mapping[str, Any], spans: Iterable[SpanRecord]) -> int:
        """Store spans exported with `resource`; returns how many were kept."""
        identity = RankIdentity.from_resource(resource)
        spans = list(spans)
        with self.lock:
            if identity is None:
                self.spans_ignored += len(spans)
                return 0
            window = self._window(identity)
            for span in spans:
                window.add_span(span)
            self.spans_received += len(spans)
        return len(spans)

    def add_metric_points(self, resource: Mapping[str, Any], points: Mapping[str, float]) -> None:
        identity = RankIdentity.from_resource(resource)
        if identity is None:
            return
        with self.lock:
            self._window(identity).metrics.update(points)
            self.metric_points_received += len(points)

    def set_heartbeat(self, resource: Mapping[str, Any], heartbeat: Heartbeat) -> None:
        identity = RankIdentity.from_resource(resource)
        if identity is None:
            return
        with self.lock:
            self._window(identity).heartbeat = heartbeat

    def heartbeats(self) -> dict[RankKey, Heartbeat | None]:
        with self.lock:
            return {key: w.heartbeat for key, w in self._ranks.items()}

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
            return sorted({job for job, _ in self._ranks})

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
