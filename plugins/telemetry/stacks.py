"""Every thread's Python stack, taken without the training thread's help.

`sys._current_frames()` hands the calling thread every other thread's current frame; reading
them needs the GIL, which a thread blocked in a collective, a data loader's queue or a C call
has released (Gloo's and NCCL's waits, `time.sleep`, socket reads all do). So the control
channel's thread can answer `plait stacks` while the training thread is stuck: it never asks
that thread to do anything, unlike a signal handler (which runs only when the stuck thread
comes back to the interpreter) or PyTorch's debug-server dumps that need the GIL held by a
thread that may never return it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from plait.plugins.telemetry.heartbeat import InflightComm

MAX_FRAMES = 256  # innermost frames kept per thread


def describe_inflight(op: InflightComm) -> str:
    """ "all_reduce seq 3 on dp [0, 1] (grad_bucket), 12.4s" for an op entered and not done."""
    waited = max(time.time_ns() - op.start_ns, 0) / 1e9
    purpose = f" ({op.purpose})" if op.purpose else ""
    return f"{op.op} seq {op.seq} on {op.group_name} {list(op.group_ranks)}{purpose}, {waited:.1f}s"


def thread_stacks(
    *,
    training_thread: int | None,
    step: int,
    inflight: Callable[[], Sequence[InflightComm]] | None = None,
) -> dict[str, Any]:
    """The document a rank delivers for `plait stacks` (`plait.daemon.deliveries.read_stacks`):
    every thread's frames, outermost first, the training thread marked."""
    frames = sys._current_frames()
    by_id = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    threads = []
    for ident, frame in frames.items():
        if ident == me:
            continue  # this thread is answering, not doing anything worth showing
        thread = by_id.get(ident)
        summary = traceback.extract_stack(frame, limit=MAX_FRAMES)
        threads.append(
            {
                "thread_id": ident,
                "name": thread.name if thread is not None else f"thread {ident}",
                "training": ident == training_thread,
                "daemon": bool(thread.daemon) if thread is not None else False,
                "frames": [
                    {
                        "file": entry.filename,
                        "line": entry.lineno or 0,
                        "function": entry.name,
                        "code": entry.line or "",
                    }
                    for entry in summary
                ],
            }
        )
    del frames  # frames hold every local of every thread: let them go now
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
