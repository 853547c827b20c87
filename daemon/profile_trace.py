"""One Perfetto / Chrome trace from every rank's `torch.profiler` trace, with plait's spans.

Each rank becomes one process, named by rank, host and mesh coordinates; its threads are the
profiler's (CPU threads by name, GPU streams as "GPU d stream s") and, above them, plait's own
step, phase and communication tracks (`plait.daemon.chrome_trace`, categories `plait.*`), so
an operator sees the kernels of a step under plait's account of it.

**Clocks.** A rank's profiler times (`ts` in µs from the trace's `baseTimeNanoseconds`) and its
spans are on the rank's clock. Each rank measures its offset to the daemon's clock when it
polls (`plait.plugins.telemetry.control_client`, NTP's way: the reply's time against the middle
of the round trip, keeping the shortest trip) and sends it with the trace; everything of the
rank is moved by that offset, so the merged trace is on the daemon's clock. `otherData` keeps,
per process, the rank, host, coordinates, offset and round trip, and the steps recorded, in
the form `plait.daemon.chrome_trace.merge_traces` reads, which is how the CLI merges daemons.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from plait.daemon.chrome_trace import chrome_trace, process_ids
from plait.daemon.deliveries import RankTrace
from plait.daemon.store import RankIdentity, SpanRecord

PLAIT_CATEGORY_PREFIX = "plait."
# Thread ids in a rank's process: plait's tracks first, then the profiler's threads.
FIRST_PROFILER_TID = 100
FLOW_PHASES = frozenset({"s", "t", "f"})
FLOW_ID_STRIDE = 1 << 40  # flow ids (correlation ids) are per rank; keep them apart


@dataclass
class RankCapture:
    """One rank's delivered trace and what the daemon knows of the rank."""

    job_id: str
    rank: int
    host: str
    trace: RankTrace
    coordinates: Mapping[str, int] = field(default_factory=dict)
    clock_offset_ns: int = 0
    clock_rtt_ns: int = 0
    first_step: int = -1
    last_step: int = -1
    spans: Sequence[tuple[RankIdentity, SpanRecord]] = ()


def process_label(capture: RankCapture) -> str:
    coordinates = ", ".join(f"{axis} {i}" for axis, i in sorted(capture.coordinates.items()))
    return f"rank {capture.rank} · {capture.host}" + (f" · {coordinates}" if coordinates else "")


def _rank_unix_ns(event: Mapping[str, Any], base_ns: int) -> int:
    return base_ns + round(event["ts"] * 1000)


def _thread_names(trace: RankTrace) -> tuple[dict[tuple[Any, Any], str], dict[Any, str]]:
    threads: dict[tuple[Any, Any], str] = {}
    processes: dict[Any, str] = {}
    for event in trace.events:
        if event["ph"] != "M":
            continue
        name = event.get("args", {}).get("name") or event.get("args", {}).get("labels")
        if event["name"] == "thread_name" and name:
            threads[(event.get("pid"), event.get("tid"))] = str(name)
        elif event["name"] == "process_labels" and name:
            processes[event.get("pid")] = str(name)
    return threads, processes


def _profiler_events(
    capture: RankCapture, pid: int, base_ns: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rank's profiler events on the merged clock, and metadata naming its threads."""
    trace = capture.trace
    shift_ns = trace.base_ns + capture.clock_offset_ns - base_ns
    thread_names, process_labels = _thread_names(trace)
    main_pid = next(
        (e.get("pid") for e in trace.events if e["ph"] == "X" and e.get("cat") == "cpu_op"), None
    )
    tids: dict[tuple[Any, Any], int] = {}
    events: list[dict[str, Any]] = []
    # NOTE: events are moved in place: the parsed trace belongs to this merge alone, and a copy
    # of every event would double what a large capture holds in memory.
    for event in trace.events:
        if event["ph"] == "M":
            continue
        key = (event.get("pid"), event.get("tid"))
        event["pid"], event["tid"] = pid, tids.setdefault(key, FIRST_PROFILER_TID + len(tids))
        event["ts"] = (event["ts"] * 1000 + shift_ns) / 1000
        if event["ph"] in FLOW_PHASES and isinstance(event.get("id"), int):
            event["id"] = capture.rank * FLOW_ID_STRIDE + event["id"]
        events.append(event)
    metadata = []
    for (source_pid, source_tid), tid in tids.items():
        name = thread_names.get((source_pid, source_tid)) or f"thread {source_tid}"
        if source_pid != main_pid:
            label = process_labels.get(source_pid) or f"process {source_pid}"
            name = f"{label} {name}" if not name.startswith(label) else name
        metadata.append(_metadata("thread_name", pid, tid, {"name": name}))
        metadata.append(_metadata("thread_sort_index", pid, tid, {"sort_index": tid}))
    return events, metadata


def _plait_events(
    capture: RankCapture, pid: int, base_ns: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """plait's spans of the rank over the captured steps, on the merged clock."""
    offset = capture.clock_offset_ns
    moved = [
        (identity, replace(span, start_ns=span.start_ns + offset, end_ns=span.end_ns + offset))
        for identity, span in capture.spans
    ]
    if not moved:
        return [], []
    document = chrome_trace(moved)
    own_base = document["otherData"]["base_unix_nano"]
    events, metadata = [], []
    for event in document["traceEvents"]:
        if event["ph"] == "M":
            if event["name"] == "thread_name":
                name = f"plait {event['args']['name']}"
                metadata.append(_metadata("thread_name", pid, event["tid"], {"name": name}))
                metadata.append(
                    _metadata("thread_sort_index", pid, event["tid"], {"sort_index": event["tid"]})
                )
            continue
        events.append(
            {
                **event,
                "pid": pid,
                "cat": PLAIT_CATEGORY_PREFIX + event["cat"],
                "ts": event["ts"] + (own_base - base_ns) / 1000,
            }
        )
    return events, metadata


def _metadata(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _earliest_ns(capture: RankCapture) -> int | None:
    starts = [
        _rank_unix_ns(e, capture.trace.base_ns) for e in capture.trace.events if e["ph"] != "M"
    ]
    starts += [span.start_ns for _, span in capture.spans]
    return min(starts) + capture.clock_offset_ns if starts else None


def merge_captures(
    captures: Sequence[RankCapture], *, request_id: str = "", start_step: int = -1, steps: int = 0
) -> dict[str, Any]:
    """The merged trace document of `captures` (one job's ranks on this daemon)."""
    earliest = [t for t in (_earliest_ns(c) for c in captures) if t is not None]
    base_ns = min(earliest, default=0)
    pids = process_ids((c.job_id, c.rank) for c in captures)
    events: list[dict[str, Any]] = []
    metadata: list[dict[str, Any]] = []
    processes: dict[str, dict[str, Any]] = {}
    for capture in sorted(captures, key=lambda c: (c.job_id, c.rank)):
        pid = pids[(capture.job_id, capture.rank)]
        metadata.append(_metadata("process_name", pid, 0, {"name": process_label(capture)}))
        metadata.append(_metadata("process_labels", pid, 0, {"labels": f"job {capture.job_id}"}))
        metadata.append(_metadata("process_sort_index", pid, 0, {"sort_index": pid}))
        for build in (_plait_events, _profiler_events):
            built, names = build(capture, pid, base_ns)
            events.extend(built)
            metadata.extend(names)
        processes[str(pid)] = {
            "job_id": capture.job_id,
            "rank": capture.rank,
            "host": capture.host,
            "coordinates": dict(capture.coordinates),
            "clock_offset_ns": capture.clock_offset_ns,
            "clock_rtt_ns": capture.clock_rtt_ns,
            "first_step": capture.first_step,
            "last_step": capture.last_step,
            "device_properties": capture.trace.metadata.get("deviceProperties", []),
        }
    events.sort(key=lambda e: e["ts"])
    return {
        "traceEvents": metadata + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "base_unix_nano": base_ns,
            "producer": "plait daemon profile",
            "processes": processes,
            "profile": {"request_id": request_id, "start_step": start_step, "steps": steps},
        },
    }
