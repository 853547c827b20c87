"""What ranks deliver through the control channel, checked at the door.

Like the span decoder (`plait.daemon.decoder`), every reader here takes bytes a rank sent and
either returns a typed record or raises `BadDelivery` naming what is wrong; a bad item inside
an otherwise good delivery (one malformed trace event, a frame without a line) is dropped alone
and counted. Nothing a rank sends is executed: a CUDA allocator snapshot is a pickle, so the
daemon passes its bytes through to the operator's files and never unpickles it.

* a profile: `trace.json.gz`, the Chrome trace `torch.profiler` exported, gzip-compressed,
  decompressed under a size cap (a small gzip may hold a huge document);
* stacks: `stacks.json`, every thread's frames (`RankStacksRecord`);
* memory: `memory.json` (RSS and model-state accounting) and, on CUDA, `snapshot.pickle`.
"""

from __future__ import annotations

import json
import math
import zlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TRACE_PART = "trace.json.gz"
STACKS_PART = "stacks.json"
MEMORY_PART = "memory.json"
SNAPSHOT_PART = "snapshot.pickle"
PARTS_BY_KIND = {
    "profile": frozenset({TRACE_PART}),
    "stacks": frozenset({STACKS_PART}),
    "memory": frozenset({MEMORY_PART, SNAPSHOT_PART}),
}
# A trace decompresses to at most this many times its compressed size (Kineto JSON compresses
# about tenfold) and never past the absolute cap.
MAX_EXPANSION = 40
MAX_TRACE_JSON_BYTES = 2 * 2**30
MAX_THREADS = 4096
MAX_FRAMES = 512
MAX_TEXT = 2000


class BadDelivery(ValueError):
    """A delivery the daemon cannot use; the message names the part and what is wrong."""


@dataclass
class RankTrace:
    """One rank's profiler trace: its events, and where their clock starts."""

    events: list[dict[str, Any]]
    base_ns: int  # add to ts (µs) × 1000 for the rank's Unix time in ns
    metadata: dict[str, Any]  # the document's other top-level fields (deviceProperties, …)
    dropped: Counter[str] = field(default_factory=Counter)  # malformed events, by reason
    json_bytes: int = 0


def check_parts(kind: str, parts: Mapping[str, bytes | bytearray]) -> None:
    allowed = PARTS_BY_KIND[kind]
    unknown = sorted(set(parts) - allowed)
    if unknown:
        raise BadDelivery(
            f"unexpected parts {unknown} in a {kind} delivery (allowed: {sorted(allowed)})"
        )


def _gunzip(data: bytes, limit: int) -> bytes:
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = decompressor.decompress(data, limit + 1)
    except zlib.error as exc:
        raise BadDelivery(f"{TRACE_PART}: not gzip data ({exc})") from None
    if len(out) > limit or decompressor.unconsumed_tail:
        raise BadDelivery(f"{TRACE_PART}: decompresses to more than {limit // 2**20} MiB")
    if not decompressor.eof:
        raise BadDelivery(f"{TRACE_PART}: truncated gzip data")
    return out


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _event_problem(event: Any) -> str:
    """Why a trace event cannot be used ("" if it can)."""
    if not isinstance(event, dict):
        return "not an object"
    phase = event.get("ph")
    if not isinstance(phase, str) or not phase:
        return "ph: missing"
    if not isinstance(event.get("name", ""), str):
        return "name: not a string"
    if not isinstance(event.get("pid", 0), int | str) or not isinstance(
        event.get("tid", 0), int | str
    ):
        return "pid/tid: not an int or string"
    if phase != "M" and not _number(event.get("ts")):
        return "ts: not a finite number"
    if phase == "X" and not (_number(event.get("dur")) and event["dur"] >= 0):
        return "dur: not a finite number >= 0"
    if "args" in event and not isinstance(event["args"], dict):
        return "args: not an object"
    return ""


def read_trace(data: bytes) -> RankTrace:
    """A rank's `trace.json.gz`; malformed events are dropped and counted by reason."""
    limit = min(max(len(data), 1) * MAX_EXPANSION, MAX_TRACE_JSON_BYTES)
    text = _gunzip(data, limit)
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise BadDelivery(f"{TRACE_PART}: not JSON ({exc})") from None
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise BadDelivery(f"{TRACE_PART}: no traceEvents list")
    base = document.get("baseTimeNanoseconds", 0)
    if not isinstance(base, int) or isinstance(base, bool) or base < 0:
        raise BadDelivery(f"{TRACE_PART}: baseTimeNanoseconds is not an integer >= 0")
    events, dropped = [], Counter[str]()
    for event in document.pop("traceEvents"):
        problem = _event_problem(event)
        if problem:
            dropped[problem] += 1
        else:
            events.append(event)
    return RankTrace(events, base, document, dropped, len(text))


@dataclass(frozen=True, slots=True)
class FrameRecord:
    file: str
    line: int
    function: str
    code: str = ""


@dataclass(frozen=True, slots=True)
class ThreadRecord:
    thread_id: int
    name: str
    training: bool
    daemon: bool
    frames: tuple[FrameRecord, ...]


@dataclass(frozen=True, slots=True)
class RankStacksRecord:
    pid: int
    step: int
    taken_ns: int
    threads: tuple[ThreadRecord, ...]
    in_flight: tuple[str, ...]


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise BadDelivery(f"{STACKS_PART}: {where} is not a string")
    return value[:MAX_TEXT]


def _int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadDelivery(f"{STACKS_PART}: {where} is not an integer")
    return value


def read_stacks(data: bytes) -> RankStacksRecord:
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadDelivery(f"{STACKS_PART}: not JSON ({exc})") from None
    if not isinstance(document, dict) or not isinstance(document.get("threads"), list):
        raise BadDelivery(f"{STACKS_PART}: no threads list")
    if len(document["threads"]) > MAX_THREADS:
        raise BadDelivery(f"{STACKS_PART}: more than {MAX_THREADS} threads")
    threads = []
    for i, thread in enumerate(document["threads"]):
        if not isinstance(thread, dict) or not isinstance(thread.get("frames"), list):
            raise BadDelivery(f"{STACKS_PART}: threads[{i}] has no frames list")
        frames = []
        for j, frame in enumerate(thread["frames"][-MAX_FRAMES:]):
            where = f"threads[{i}].frames[{j}]"
            if not isinstance(frame, dict):
                raise BadDelivery(f"{STACKS_PART}: {where} is not an object")
            frames.append(
                FrameRecord(
                    file=_text(frame.get("file"), f"{where}.file"),
                    line=_int(frame.get("line"), f"{where}.line"),
                    function=_text(frame.get("function"), f"{where}.function"),
                    code=_text(frame.get("code", ""), f"{where}.code"),
                )
            )
        threads.append(
            ThreadRecord(
                thread_id=_int(thread.get("thread_id"), f"threads[{i}].thread_id"),
                name=_text(thread.get("name", ""), f"threads[{i}].name"),
                training=bool(thread.get("training")),
                daemon=bool(thread.get("daemon")),
                frames=tuple(frames),
            )
        )
    in_flight = document.get("in_flight", [])
    if not isinstance(in_flight, list):
        raise BadDelivery(f"{STACKS_PART}: in_flight is not a list")
    return RankStacksRecord(
        pid=_int(document.get("pid", 0), "pid"),
        step=_int(document.get("step", -1), "step"),
        taken_ns=_int(document.get("taken_unix_nano", 0), "taken_unix_nano"),
        threads=tuple(threads),
        in_flight=tuple(_text(s, "in_flight[]") for s in in_flight[:MAX_THREADS]),
    )


def read_memory(parts: Mapping[str, bytes | bytearray]) -> dict[str, bytes]:
    """The files of a memory delivery, checked: `memory.json` must be a JSON object; the
    snapshot is passed through as it came (never unpickled here)."""
    check_parts("memory", parts)
    if MEMORY_PART not in parts:
        raise BadDelivery(f"a memory delivery without {MEMORY_PART}")
    try:
        accounting = json.loads(parts[MEMORY_PART])
    except (ValueError, RecursionError) as exc:
        raise BadDelivery(f"{MEMORY_PART}: not JSON ({exc})") from None
    if not isinstance(accounting, dict):
        raise BadDelivery(f"{MEMORY_PART}: not a JSON object")
    return {name: bytes(data) for name, data in parts.items()}
