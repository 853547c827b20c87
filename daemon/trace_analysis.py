"""Analysis of a profile capture, in Holistic Trace Analysis' vocabulary, while it is fresh.

Input: a merged capture (`plait.daemon.profile_trace`): one process per rank holding the
rank's `torch.profiler` events and plait's own spans (categories `plait.*`), on one clock.
Output: plain dataclasses, no gRPC (`plait.daemon.control_service` translates them).

Per rank, over the captured steps (the union of its `ProfilerStep#N` annotations):

* **Timeline.** On CUDA the device's: kernels, memory copies and sets, as CUPTI recorded them.
  A kernel whose name holds "nccl" is communication (HTA's rule; NCCL names its kernels
  `ncclDevKernel_*` / `ncclKernel_*`), memcpy/memset events are memory, every other kernel is
  compute. Without a GPU, the CPU operators of every thread stand in for kernels: collectives
  (`gloo:*` / `nccl:*` annotations, `c10d::*` and `record_param_comms` operators, and every
  operator nested in one — a backend thread's reduction is part of its collective) are
  communication, top-level copies (`aten::copy_`, `aten::to`, …) memory, the rest compute.
* **Temporal breakdown.** Each instant of the window counts once, first match wins: compute;
  communication, except while the rank waits for a peer to enter the collective; memory copy;
  idle waiting on other ranks (inside a collective that a peer has not entered yet: plait's comm
  spans of every rank, matched by group and sequence number); idle host-bound (nothing to run:
  the device waits for the host, or on CPU the interpreter runs between operators). The five
  add up to the window exactly.
* **Comm–compute overlap** (HTA's definition): compute time during communication ÷
  communication time, over all communication (waiting included, as a kernel's time is).
* **Kernel launches** (HTA's launch statistics): runtime calls that launch work, their CPU
  time, the launch delay (kernel start − launch start, matched by correlation id) and the
  kernels shorter than their launch.
* **Top operators**: kernels by total time, or on CPU operators by self time.

Across ranks (`summarize`): the slowest rank is the one doing the most besides waiting for
peers, and the class that makes it slow is the one where it exceeds the other ranks' median
the most.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Interval = tuple[int, int]  # [start, end) in nanoseconds from the capture's base

COMPUTE, COMMUNICATION, MEMORY = "compute", "communication", "memory"
CUDA_TIMELINE, CPU_TIMELINE = "cuda", "cpu"
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
LAUNCH_NAMES = frozenset(
    {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
     "cudaLaunchCooperativeKernel", "cudaLaunchCooperativeKernelMultiDevice",
     "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch"}
)  # fmt: skip
STEP_ANNOTATION = re.compile(r"^ProfilerStep#(\d+)$")
CPU_COMM_ANNOTATION = re.compile(r"^(gloo|nccl|mpi|ucc|xccl):", re.IGNORECASE)
CPU_COMM_OPS = re.compile(r"^(c10d::|c10d_functional::|_c10d_functional::|record_param_comms$)")
CPU_COPY_OPS = frozenset(
    {"aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous",
     "aten::pin_memory", "aten::_pin_memory"}
)  # fmt: skip
POINT_TO_POINT = frozenset({"send", "recv"})
PLAIT_COMM_CATEGORY = "plait.comm"
TOP_OPS = 10


# --------------------------------------------------------------------------------------------
# interval sets: sorted, disjoint lists of [start, end)
# --------------------------------------------------------------------------------------------


def union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    out: list[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def length(intervals: Iterable[Interval]) -> int:
    return sum(end - start for start, end in intervals)


# --------------------------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TopOp:
    name: str
    kind: str
    count: int
    seconds: float


@dataclass(frozen=True, slots=True)
class RankTraceFigures:
    job_id: str
    rank: int
    host: str
    timeline: str
    steps: int
    window_seconds: float
    compute_seconds: float
    communication_seconds: float
    memory_seconds: float
    idle_host_seconds: float
    idle_peer_wait_seconds: float
    communication_total_seconds: float
    overlap_fraction: float
    launches: int = 0
    launch_cpu_seconds: float = 0.0
    launch_delay_mean_seconds: float = 0.0
    launch_delay_max_seconds: float = 0.0
    short_kernels: int = 0
    top_ops: tuple[TopOp, ...] = ()

    @property
    def idle_seconds(self) -> float:
        return self.idle_host_seconds + self.idle_peer_wait_seconds

    @property
    def busy_seconds(self) -> float:
        """Everything but waiting for peers: what the rank's own work took."""
        return self.window_seconds - self.idle_peer_wait_seconds

    def by_class(self) -> dict[str, float]:
        return {
            COMPUTE: self.compute_seconds,
            COMMUNICATION: self.communication_seconds,
            MEMORY: self.memory_seconds,
            "idle (host-bound)": self.idle_host_seconds,
        }


@dataclass(frozen=True, slots=True)
class CrossRankSummary:
    slowest_rank: int = -1
    slowest_class: str = ""
    excess_seconds: float = 0.0
    others_wait_seconds: float = 0.0
    verdict: str = "no rank delivered a trace"


@dataclass(frozen=True, slots=True)
class TraceAnalysis:
    ranks: tuple[RankTraceFigures, ...]
    summary: CrossRankSummary


# --------------------------------------------------------------------------------------------
# one rank
# --------------------------------------------------------------------------------------------


def _span(event: Mapping[str, Any]) -> Interval:
    start = round(event["ts"] * 1000)
    return (start, start + round(event.get("dur", 0) * 1000))


def _nesting(events: Sequence[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], int]]:
    """One thread's events, parents before children, each with the position of its enclosing
    event in the returned list (-1: top level)."""
    ordered = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    spans = [_span(e) for e in ordered]
    stack: list[int] = []
    nested: list[tuple[Mapping[str, Any], int]] = []
    for i, (start, end) in enumerate(spans):
        while stack and spans[stack[-1]][1] <= start:
            stack.pop()
        parent = stack[-1] if stack and spans[stack[-1]][1] >= end else -1
        nested.append((ordered[i], parent))
        stack.append(i)
    return nested


def _is_cpu_comm(event: Mapping[str, Any]) -> bool:
    name = event.get("name", "")
    return bool(CPU_COMM_ANNOTATION.match(name) or CPU_COMM_OPS.match(name))


@dataclass
class _Timeline:
    compute: list[Interval] = field(default_factory=list)
    communication: list[Interval] = field(default_factory=list)
    memory: list[Interval] = field(default_factory=list)
    top: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # -> [count, ns]

    def add_top(self, name: str, kind: str, ns: int) -> None:
        entry = self.top.setdefault((name, kind), [0, 0])
        entry[0] += 1
        entry[1] += ns


def _cuda_timeline(events: Sequence[Mapping[str, Any]], window: Sequence[Interval]) -> _Timeline:
    timeline = _Timeline()
    compute, communication, memory = [], [], []
    for event in events:
        if event.get("ph") != "X" or event.get("cat") not in DEVICE_CATEGORIES:
            continue
        span = _span(event)
        kind = kernel_class(event)
        {COMPUTE: compute, COMMUNICATION: communication, MEMORY: memory}[kind].append(span)
        if _starts_in(event, window):
            timeline.add_top(event["name"], kind, span[1] - span[0])
    timeline.compute, timeline.communication = union(compute), union(communication)
    timeline.memory = union(memory)
    return timeline


def kernel_class(event: Mapping[str, Any]) -> str:
    """compute, communication or memory, for a device event (HTA's classification)."""
    if event.get("cat") in ("gpu_memcpy", "gpu_memset"):
        return MEMORY
    return COMMUNICATION if "nccl" in event.get("name", "").lower() else COMPUTE


def _cpu_kinds(nested: Sequence[tuple[Mapping[str, Any], int]]) -> list[str]:
    """Each operator's class: communication if it or an enclosing one is a collective, memory
    if it or an enclosing one is a copy at the top level, else compute."""
    kinds: list[str] = []
    for event, parent in nested:
        inherited = kinds[parent] if parent >= 0 else ""
        if inherited == COMMUNICATION or _is_cpu_comm(event):
            kinds.append(COMMUNICATION)
        elif inherited == MEMORY or (parent < 0 and event.get("name") in CPU_COPY_OPS):
            kinds.append(MEMORY)
        else:
            kinds.append(COMPUTE)
    return kinds


def _cpu_timeline(events: Sequence[Mapping[str, Any]], window: Sequence[Interval]) -> _Timeline:
    timeline = _Timeline()
    by_thread: dict[Any, list[Mapping[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("ph") != "X":
            continue
        category = event.get("cat")
        if category == "cpu_op" or (category == "user_annotation" and _is_cpu_comm(event)):
            by_thread[event.get("tid")].append(event)
    compute, communication, memory = [], [], []
    for thread_events in by_thread.values():
        nested = _nesting(thread_events)
        kinds = _cpu_kinds(nested)
        children_ns = [0] * len(nested)
        for event, parent in nested:
            if parent >= 0:
                start, end = _span(event)
                children_ns[parent] += end - start
        spans, comm, copies = [], [], []
        for i, (event, _) in enumerate(nested):
            span = _span(event)
            spans.append(span)
            if kinds[i] == COMMUNICATION:
                comm.append(span)
            elif kinds[i] == MEMORY:
                copies.append(span)
            if event.get("cat") == "cpu_op" and _starts_in(event, window):
                timeline.add_top(event["name"], kinds[i], span[1] - span[0] - children_ns[i])
        comm_set = union(comm)
        copy_set = subtract(union(copies), comm_set)
        communication.extend(comm_set)
        memory.extend(copy_set)
        compute.extend(subtract(subtract(union(spans), comm_set), copy_set))
    timeline.compute, timeline.communication = union(compute), union(communication)
    timeline.memory = union(memory)
    return timeline


def step_windows(events: Iterable[Mapping[str, Any]]) -> dict[int, Interval]:
    """step -> its `ProfilerStep#N` annotation's interval."""
    windows: dict[int, Interval] = {}
    for event in events:
        if event.get("ph") == "X" and event.get("cat") in ("user_annotation", "cpu_op"):
            match = STEP_ANNOTATION.match(event.get("name", ""))
            if match:
                windows[int(match.group(1))] = _span(event)
    return windows


def _window(events: Sequence[Mapping[str, Any]], steps: Mapping[int, Interval]) -> list[Interval]:
    """The captured time: the steps' annotations, else the profiler's own span, else the
    extent of everything recorded."""
    if steps:
        return union(steps.values())
    spans = [_span(e) for e in events if e.get("ph") == "X" and e.get("cat") == "Trace"]
    if not spans:
        spans = [_span(e) for e in events if e.get("ph") == "X" and "dur" in e]
    if not spans:
        return []
    return [(min(s for s, _ in spans), max(e for _, e in spans))]


def _starts_in(event: Mapping[str, Any], window: Sequence[Interval]) -> bool:
    start = _span(event)[0]
    return any(s <= start < e for s, e in window)


def peer_waits(events: Iterable[Mapping[str, Any]]) -> dict[Any, list[Interval]]:
    """pid -> the time it sat in a collective before the last rank of the group entered it,
    from plait's comm spans (group and sequence number match a collective across ranks)."""
    entries: dict[tuple[Any, ...], list[tuple[Any, Interval]]] = defaultdict(list)
    for event in events:
        if event.get("cat") != PLAIT_COMM_CATEGORY or event.get("ph") != "X":
            continue
        args = event.get("args", {})
        if args.get("plait.comm.op") in POINT_TO_POINT or "plait.comm.seq" not in args:
            continue
        key = (
            str(args.get("plait.comm.group", "")),
            tuple(args.get("plait.comm.group_ranks", ())),
            args["plait.comm.seq"],
        )
        entries[key].append((event["pid"], _span(event)))
    waits: dict[Any, list[Interval]] = defaultdict(list)
    for members in entries.values():
        if len({pid for pid, _ in members}) < 2:
            continue
        last_entry = max(span[0] for _, span in members)
        for pid, (start, end) in members:
            if start < last_entry:
                waits[pid].append((start, min(last_entry, end)))
    return {pid: union(intervals) for pid, intervals in waits.items()}


def _launch_figures(
    events: Sequence[Mapping[str, Any]], window: Sequence[Interval]
) -> dict[str, Any]:
    kernels = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in DEVICE_CATEGORIES and "correlation" in e.get("args", {})
    }
    launches, cpu_ns, delays, short = 0, 0, [], 0
    for event in events:
        if event.get("cat") not in LAUNCH_CATEGORIES or event.get("name") not in LAUNCH_NAMES:
            continue
        if not _starts_in(event, window):
            continue
        launches += 1
        start, end = _span(event)
        cpu_ns += end - start
        kernel = kernels.get(event.get("args", {}).get("correlation"))
        if kernel is not None:
            kernel_start, kernel_end = _span(kernel)
            delays.append(max(kernel_start - start, 0))
            short += kernel_end - kernel_start < end - start
    return {
        "launches": launches,
        "launch_cpu_seconds": cpu_ns / 1e9,
        "launch_delay_mean_seconds": statistics.fmean(delays) / 1e9 if delays else 0.0,
        "launch_delay_max_seconds": max(delays, default=0) / 1e9,
        "short_kernels": short,
    }


def analyze_rank(
    events: Sequence[Mapping[str, Any]],
    *,
    job_id: str = "",
    rank: int = 0,
    host: str = "",
    waits: Sequence[Interval] = (),
) -> RankTraceFigures:
    """One rank's figures from its events (`waits`: its peer waits, from `peer_waits`)."""
    steps = step_windows(events)
    window = _window(events, steps)
    cuda = any(e.get("cat") in DEVICE_CATEGORIES for e in events)
    complete = [e for e in events if e.get("ph") == "X"]
    timeline = _cuda_timeline(complete, window) if cuda else _cpu_timeline(complete, window)
    compute = intersect(timeline.compute, window)
    communication = intersect(timeline.communication, window)
    memory = intersect(timeline.memory, window)
    waiting = intersect(union(waits), window)
    talking = subtract(subtract(communication, waiting), compute)
    copying = subtract(subtract(memory, compute), talking)
    busy = union([*compute, *talking, *copying])
    peer_wait = subtract(waiting, busy)
    idle_host = subtract(subtract(window, busy), peer_wait)
    total_comm = length(communication)
    top = sorted(timeline.top.items(), key=lambda kv: -kv[1][1])[:TOP_OPS]
    return RankTraceFigures(
        job_id=job_id,
        rank=rank,
        host=host,
        timeline=CUDA_TIMELINE if cuda else CPU_TIMELINE,
        steps=len(steps),
        window_seconds=length(window) / 1e9,
        compute_seconds=length(compute) / 1e9,
        communication_seconds=length(talking) / 1e9,
        memory_seconds=length(copying) / 1e9,
        idle_host_seconds=length(idle_host) / 1e9,
        idle_peer_wait_seconds=length(peer_wait) / 1e9,
        communication_total_seconds=total_comm / 1e9,
        overlap_fraction=length(intersect(compute, communication)) / total_comm
        if total_comm
        else 0.0,
        top_ops=tuple(
            TopOp(name=name, kind=kind, count=int(count), seconds=ns / 1e9)
            for (name, kind), (count, ns) in top
        ),
        **(_launch_figures(events, window) if cuda else {}),
    )


def analyze(document: Mapping[str, Any]) -> TraceAnalysis:
    """Every rank of a merged capture (`plait.daemon.profile_trace`), and the summary."""
    processes = document.get("otherData", {}).get("processes", {})
    by_pid: dict[Any, list[Mapping[str, Any]]] = defaultdict(list)
    for event in document.get("traceEvents", ()):
        if event.get("ph") != "M":
            by_pid[event.get("pid")].append(event)
    waits = peer_waits(e for events in by_pid.values() for e in events)
    figures = []
    for pid, events in sorted(by_pid.items(), key=lambda kv: str(kv[0])):
        info = processes.get(str(pid), {})
        figures.append(
            analyze_rank(
                events,
                job_id=str(info.get("job_id", "")),
                rank=int(info.get("rank", pid if isinstance(pid, int) else -1)),
                host=str(info.get("host", "")),
                waits=waits.get(pid, ()),
            )
        )
    figures.sort(key=lambda f: (f.job_id, f.rank))
    return TraceAnalysis(ranks=tuple(figures), summary=summarize(figures))


def summarize(ranks: Sequence[RankTraceFigures]) -> CrossRankSummary:
    """The slowest rank (most time besides waiting for peers) and the class that makes it
    slow (its largest excess over the other ranks' median)."""
    if not ranks:
        return CrossRankSummary()
    slowest = max(ranks, key=lambda r: (r.busy_seconds, -r.rank))
    others = [r for r in ranks if r is not slowest]
    own = slowest.by_class()
    if not others:
        kind = max(own, key=lambda k: own[k])
        return CrossRankSummary(
            slowest_rank=slowest.rank,
            slowest_class=kind,
            excess_seconds=own[kind],
            verdict=f"rank {slowest.rank} alone: {_share(own[kind], slowest)} of its captured "
            f"time is {kind}",
        )
    excess = {k: v - statistics.median(o.by_class()[k] for o in others) for k, v in own.items()}
    kind = max(excess, key=lambda k: excess[k])
    wait = statistics.median(o.idle_peer_wait_seconds for o in others)
    return CrossRankSummary(
        slowest_rank=slowest.rank,
        slowest_class=kind,
        excess_seconds=excess[kind],
        others_wait_seconds=wait,
        verdict=(
            f"rank {slowest.rank} is the slowest: {excess[kind] * 1e3:.1f} ms more {kind} than "
            f"the median of the other ranks over {slowest.steps} steps; they waited "
            f"{wait * 1e3:.1f} ms on peers"
        ),
    )


def _share(seconds: float, figures: RankTraceFigures) -> str:
    return f"{seconds / figures.window_seconds:.0%}" if figures.window_seconds else "0%"
