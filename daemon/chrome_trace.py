"""Spans as Chrome trace events (the JSON `chrome://tracing` and Perfetto open).

One process per rank (pid = rank) and one thread per stream inside it: the step, the compute
phases, data loading, and one track per communication group, so overlapping collectives and
compute show side by side. Every span is a complete event (`"ph": "X"`) with `ts` and `dur` in
microseconds, measured from the earliest span in the capture (the absolute start is kept in
`otherData.base_unix_nano`); metadata events name processes and threads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from plait.core import telemetry_schema as names
from plait.daemon.store import RankIdentity, SpanRecord

STEP_TID = 0
COMPUTE_TID = 1
DATA_TID = 2
OTHER_TID = 3
FIRST_COMM_TID = 10
_FIXED_THREADS = {STEP_TID: "step", COMPUTE_TID: "compute", DATA_TID: "data", OTHER_TID: "other"}


def _json_safe(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return str(value)


def _metadata(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def chrome_trace(spans: Iterable[tuple[RankIdentity, SpanRecord]]) -> dict[str, Any]:
    """The trace document for `spans` (identity of the sending rank, span)."""
    spans = sorted(spans, key=lambda item: (item[0].rank, item[1].start_ns))
    base_ns = min((span.start_ns for _, span in spans), default=0)
    comm_tids: dict[str, int] = {}
    threads: dict[tuple[int, int], str] = {}
    processes: dict[int, str] = {}
    events: list[dict[str, Any]] = []
    for identity, span in spans:
        pid = identity.rank
        processes.setdefault(pid, f"rank {identity.rank} ({identity.host}, job {identity.job_id})")
        if span.kind == "comm":
            group = str(span.attributes.get(names.SPAN_COMM_GROUP, "?"))
            tid = comm_tids.setdefault(group, FIRST_COMM_TID + len(comm_tids))
            thread_name = f"comm {group}"
            category = "comm"
        elif span.kind == "step":
            tid, thread_name, category = STEP_TID, _FIXED_THREADS[STEP_TID], "step"
        elif span.kind == "phase" and span.name == "data":
            tid, thread_name, category = DATA_TID, _FIXED_THREADS[DATA_TID], "data"
        elif span.kind == "phase":
            tid, thread_name, category = COMPUTE_TID, _FIXED_THREADS[COMPUTE_TID], "phase"
        else:
            tid, thread_name, category = OTHER_TID, _FIXED_THREADS[OTHER_TID], "other"
        threads.setdefault((pid, tid), thread_name)
        events.append(
            {
                "name": span.name,
                "cat": category,
                "ph": "X",
                "ts": (span.start_ns - base_ns) / 1e3,
                "dur": max(span.end_ns - span.start_ns, 0) / 1e3,
                "pid": pid,
                "tid": tid,
                "args": _json_safe(span.attributes),
            }
        )
    metadata: list[dict[str, Any]] = []
    for pid, name in sorted(processes.items()):
        metadata.append(_metadata("process_name", pid, 0, {"name": name}))
        metadata.append(_metadata("process_sort_index", pid, 0, {"sort_index": pid}))
    for (pid, tid), name in sorted(threads.items()):
        metadata.append(_metadata("thread_name", pid, tid, {"name": name}))
    return {
        "traceEvents": metadata + events,
        "displayTimeUnit": "ms",
        "otherData": {"base_unix_nano": base_ns, "producer": "plait daemon"},
    }


def chrome_trace_json(spans: Iterable[tuple[RankIdentity, SpanRecord]]) -> bytes:
    return json.dumps(chrome_trace(spans), separators=(",", ":")).encode()


def merge_traces(documents: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One trace from several daemons' captures (ranks are unique across a job's nodes).

    Each capture's times are relative to its own earliest span; they are rebased on the
    earliest of all so the hosts line up.
    """
    documents = [d for d in documents if d.get("traceEvents")]
    if not documents:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {"base_unix_nano": 0}}
    base_ns = min(int(d["otherData"]["base_unix_nano"]) for d in documents)
    events: list[dict[str, Any]] = []
    for document in documents:
        shift_us = (int(document["otherData"]["base_unix_nano"]) - base_ns) / 1e3
        for event in document["traceEvents"]:
            if event["ph"] != "M":
                event = {**event, "ts": event["ts"] + shift_us}
            events.append(event)
    events.sort(key=lambda e: (e["ph"] != "M", e["ts"]))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"base_unix_nano": base_ns, "producer": "plait daemon"},
    }
