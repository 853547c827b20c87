"""Every thread's Python stack, taken without the training thread's help.

`sys._current_frames()` hands the calling thread every other thread's current frame; reading
them needs the GIL, which a thread blocked in a collective, a data loader's queue or a C call
has released (Gloo's and NCCL's waits, `time.sleep`, socket reads all do). So the control
channel's thread can answer `plait stacks` while the training thread is stuck: it never asks
that thread to do anything, unlike a signal handler (which runs only when the stuck thread
comes back to the interpreter) or PyTorch's debug-server dumps that need the GIL held by a
thread that may never return it.

Walking a frame's `f_back` chain can stop short: on CPython 3.11 a generator expression's
frame seen from another thread has been found with no `f_back` while its caller was still on
the stack. `faulthandler` walks the thread's own frame list in C, which has no such gap, so
each thread's chain is checked against it and replaced by it when it holds more frames (source
lines read back with `linecache`; faulthandler keeps the innermost 100).
"""

from __future__ import annotations

import faulthandler
import json
import linecache
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from plait.plugins.telemetry.heartbeat import InflightComm

MAX_FRAMES = 256  # innermost frames kept per thread
# A thread's outermost frame is its bootstrap or a module, never a generator expression: one
# there is the gap described above. Both walks are retaken this many times at most.
GAP = "<genexpr>"
SNAPSHOT_TRIES = 5


def describe_inflight(op: InflightComm) -> str:
    """ "all_reduce seq 3 on dp [0, 1] (grad_bucket), 12.4s" for an op entered and not done."""
    waited = max(time.time_ns() - op.start_ns, 0) / 1e9
    purpose = f" ({op.purpose})" if op.purpose else ""
    return f"{op.op} seq {op.seq} on {op.group_name} {list(op.group_ranks)}{purpose}, {waited:.1f}s"


FAULTHANDLER_THREAD = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-f]+) ")
FAULTHANDLER_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


def faulthandler_stacks() -> dict[int, list[dict[str, Any]]]:
    """thread id -> its frames, outermost first, as faulthandler walks them in C."""
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.seek(0)
        text = out.read()
    stacks: dict[int, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] | None = None
    for line in text.splitlines():
        header = FAULTHANDLER_THREAD.match(line)
        if header:
            current = stacks.setdefault(int(header.group(1), 16), [])
            continue
        frame = FAULTHANDLER_FRAME.match(line)
        if frame and current is not None:
            path, number = frame.group(1), int(frame.group(2))
            code = linecache.getline(path, number).strip()
            current.append({"file": path, "line": number, "function": frame.group(3), "code": code})
    for frames in stacks.values():
        frames.reverse()  # faulthandler prints the most recent call first
    return stacks


def _walked(frame: Any) -> list[dict[str, Any]]:
    return [
        {"file": e.filename, "line": e.lineno or 0, "function": e.name, "code": e.line or ""}
        for e in traceback.extract_stack(frame, limit=MAX_FRAMES)
    ]


def _snapshot(training_thread: int | None) -> list[dict[str, Any]]:
    frames = sys._current_frames()
    checked = faulthandler_stacks()
    by_id = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    threads = []
    for ident, frame in frames.items():
        if ident == me:
            continue  # this thread is answering, not doing anything worth showing
        thread = by_id.get(ident)
        walked = _walked(frame)
        in_c = checked.get(ident, [])
        threads.append(
            {
                "thread_id": ident,
                "name": thread.name if thread is not None else f"thread {ident}",
                "training": ident == training_thread,
                "daemon": bool(thread.daemon) if thread is not None else False,
                "frames": in_c if len(in_c) > len(walked) else walked,
            }
        )
    del frames  # frames hold every local of every thread: let them go now
    return threads


def thread_stacks(
    *,
    training_thread: int | None,
    step: int,
    inflight: Callable[[], Sequence[InflightComm]] | None = None,
) -> dict[str, Any]:
    """The document a rank delivers for `plait stacks` (`plait.daemon.deliveries.read_stacks`):
    every thread's frames, outermost first, the training thread marked."""
    for _ in range(SNAPSHOT_TRIES):
        threads = _snapshot(training_thread)
        # The two walks are taken a moment apart while the threads run on: when a chain
        # stopped at a generator expression's gap and faulthandler's walk (taken elsewhere in
        # the thread's run) was no longer, take both again.
        if not any(t["frames"] and t["frames"][0]["function"] == GAP for t in threads):
            break
    threads.sort(key=lambda t: (not t["training"], t["name"]))
    ops = inflight() if inflight is not None else ()
    return {
        "pid": os.getpid(),
        "step": step,
        "taken_unix_nano": time.time_ns(),
        "threads": threads,
        "in_flight": [describe_inflight(op) for op in ops],
    }


def stacks_json(**kwargs: Any) -> bytes:
    return json.dumps(thread_stacks(**kwargs), separators=(",", ":")).encode()
