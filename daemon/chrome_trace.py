"""Spans as Chrome trace events (the JSON `chrome://tracing` and Perfetto open).

One process per rank and one thread per stream inside it: the step, the compute phases, data
loading, and one track per communication group, so overlapping collectives and compute show
side by side. The process id is the rank when the capture holds one job; with several, ranks of
different jobs would share a process, so each job gets its own block of ids (`JOB_PID_STRIDE` ×
the job's index in job-id order, plus the rank). `otherData.processes` maps each id back to its
job and rank, which is how `merge_traces` renumbers the captures of several daemons.

Every span is a complete event (`"ph": "X"`) with `ts` and `dur` in microseconds, measured from
the earliest span in the capture (the absolute start is kept in `otherData.base_unix_nano`);
metadata events name processes and threads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from plait.daemon import telemetry_schema as names
from plait.daemon.store import RankIdentity, SpanRecord

STEP_TID = 0
COMPUTE_TID = 1
DATA_TID = 2
OTHER_TID = 3
FIRST_COMM_TID = 10
_FIXED_THREADS = {STEP_TID: "step", COMPUTE_TID: "compute", DATA_TID: "data", OTHER_TID: "other"}
JOB_PID_STRIDE = 100_000  # process ids of the n-th job (several jobs): n * stride + rank


def process_ids(keys: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """(job id, rank) -> process id: the rank for one job, job-blocked ids for several."""
    keys = sorted(set(keys))
    jobs = sorted({job_id for job_id, _ in keys})
    if len(jobs) <= 1:
        return {key: key[1] for key in keys}
    index = {job_id: i for i, job_id in enumerate(jobs)}
    return {(job_id, rank): index[job_id] * JOB_PID_STRIDE + rank for job_id, rank in keys}


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        # JSON has no NaN or infinity (a diverging loss is NaN); trace viewers refuse them.
        return str(value)
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
    spans = sorted(spans, key=lambda item: (item[0].job_id, item[0].rank, item[1].start_ns))
    base_ns = min((span.start_ns for _, span in spans), default=0)
    pids = process_ids((identity.job_id, identity.rank) for identity, _ in spans)
    comm_tids: dict[str, int] = {}
    threads: dict[tuple[int, int], str] = {}
    processes: dict[int, str] = {}
    events: list[dict[str, Any]] = []
    for identity, span in spans:
        pid = pids[(identity.job_id, identity.rank)]
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
        "otherData": {
            "base_unix_nano": base_ns,
            "producer": "plait daemon",
            "processes": {str(pid): {"job_id": j, "rank": r} for (j, r), pid in pids.items()},
        },
    }


def chrome_trace_json(spans: Iterable[tuple[RankIdentity, SpanRecord]]) -> bytes:
    return json.dumps(chrome_trace(spans), separators=(",", ":"), allow_nan=False).encode()


def merge_traces(documents: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One trace from several daemons' captures (ranks are unique within a job's world).

    Each capture's times are relative to its own earliest span; they are rebased on the
    earliest of all so the hosts line up. Process ids are renumbered over all captures (a job
    one daemon sees alone may share the trace with another job a second daemon sees).
    """
    documents = [d for d in documents if d.get("traceEvents")]
    if not documents:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {"base_unix_nano": 0}}
    base_ns = min(int(d["otherData"]["base_unix_nano"]) for d in documents)
    keys = [_process_keys(d) for d in documents]
    pids = process_ids(key for document_keys in keys for key in document_keys.values())
    # What a capture says of its processes beyond job and rank (host, clock offset, …).
    details = {
        keys[i][int(pid)]: process
        for i, document in enumerate(documents)
        for pid, process in document["otherData"].get("processes", {}).items()
    }
    events: list[dict[str, Any]] = []
    for document, document_keys in zip(documents, keys, strict=True):
        shift_us = (int(document["otherData"]["base_unix_nano"]) - base_ns) / 1e3
        for event in document["traceEvents"]:
            event = {**event, "pid": pids[document_keys[event["pid"]]]}
            if event["ph"] != "M":
                event["ts"] += shift_us
            elif event["name"] == "process_sort_index":
                event["args"] = {"sort_index": event["pid"]}
            events.append(event)
    events.sort(key=lambda e: (e["ph"] != "M", e["ts"]))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "base_unix_nano": base_ns,
            "producer": "plait daemon",
            "processes": {
                str(pid): {**details.get((j, r), {}), "job_id": j, "rank": r}
                for (j, r), pid in pids.items()
            },
        },
    }


def _process_keys(document: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """pid -> (job id, rank) of one capture (one job, pid = rank, for captures without it)."""
    processes = document["otherData"].get("processes")
    if processes is None:
        return {e["pid"]: ("", e["pid"]) for e in document["traceEvents"]}
    return {int(pid): (p["job_id"], int(p["rank"])) for pid, p in processes.items()}
