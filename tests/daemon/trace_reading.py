"""An independent reading of a merged capture, for checking the daemon's analysis.

The analysis (`plait.daemon.trace_analysis`) works on sorted interval lists; this reads the
same trace file by painting every event onto a 100 ns grid with numpy and counting cells. The
definitions are the documented ones (HTA's temporal breakdown with plait's idle split); the
arithmetic shares nothing with the code under test.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

RESOLUTION_US = 0.1
COMM_NAME = re.compile(
    r"^(gloo|nccl|mpi|ucc|xccl):|^c10d::|^c10d_functional::|^_c10d_functional::|^record_param_comms$",
    re.I,
)
COPY_OPS = {"aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous",
            "aten::pin_memory", "aten::_pin_memory"}  # fmt: skip


@dataclass(frozen=True)
class Reading:
    window: float  # seconds
    compute: float
    communication: float
    memory: float
    idle_peer_wait: float
    idle_host: float
    communication_total: float
    overlap: float
    steps: tuple[int, ...]


class Grid:
    def __init__(self, start_us: float, end_us: float) -> None:
        self.start = start_us
        self.size = int(np.ceil((end_us - start_us) / RESOLUTION_US)) + 2

    def mask(self, intervals: list[tuple[float, float]]) -> np.ndarray:
        mask = np.zeros(self.size, dtype=bool)
        for start, end in intervals:
            a = round((start - self.start) / RESOLUTION_US)
            b = round((end - self.start) / RESOLUTION_US)
            mask[max(a, 0) : max(b, 0)] = True
        return mask


def _seconds(mask: np.ndarray) -> float:
    return float(mask.sum()) * RESOLUTION_US / 1e6


def _top_level(events: list[dict]) -> list[bool]:
    """Whether each event (sorted by start, longer first) starts after everything before it
    has ended: a sweep over the largest end seen, not a stack."""
    flags, reach = [], float("-inf")
    for event in events:
        flags.append(event["ts"] >= reach)
        reach = max(reach, event["ts"] + event["dur"])
    return flags


def read_rank(document: dict, pid: int) -> Reading:
    events = [e for e in document["traceEvents"] if e.get("pid") == pid and e["ph"] == "X"]
    steps = {}
    for e in events:
        match = re.match(r"^ProfilerStep#(\d+)$", e["name"])
        if match and e["cat"] == "user_annotation":
            steps[int(match.group(1))] = (e["ts"], e["ts"] + e["dur"])
    grid = Grid(min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events))
    window = grid.mask(list(steps.values()))
    by_thread: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        comm_annotation = e["cat"] == "user_annotation" and COMM_NAME.match(e["name"])
        if e["cat"] == "cpu_op" or comm_annotation:
            by_thread[e["tid"]].append(e)
    compute = np.zeros(grid.size, dtype=bool)
    comm = np.zeros(grid.size, dtype=bool)
    copy = np.zeros(grid.size, dtype=bool)
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in thread_events]
        thread_comm = grid.mask(
            [s for s, e in zip(spans, thread_events, strict=True) if COMM_NAME.match(e["name"])]
        )
        top = _top_level(thread_events)
        thread_copy = (
            grid.mask(
                [
                    s
                    for s, e, t in zip(spans, thread_events, top, strict=True)
                    if t and e["name"] in COPY_OPS
                ]
            )
            & ~thread_comm
        )
        compute |= grid.mask(spans) & ~thread_comm & ~thread_copy
        comm |= thread_comm
        copy |= thread_copy
    wait = grid.mask(_peer_waits(document).get(pid, []))
    c = window & compute
    talk = window & comm & ~wait & ~c
    mem = window & copy & ~c & ~talk
    peer = window & wait & ~c & ~mem & ~talk
    host = window & ~(c | talk | mem | peer)
    total_comm = window & comm
    return Reading(
        window=_seconds(window),
        compute=_seconds(c),
        communication=_seconds(talk),
        memory=_seconds(mem),
        idle_peer_wait=_seconds(peer),
        idle_host=_seconds(host),
        communication_total=_seconds(total_comm),
        overlap=_seconds(c & comm) / _seconds(total_comm) if total_comm.any() else 0.0,
        steps=tuple(sorted(steps)),
    )


def _peer_waits(document: dict) -> dict[int, list[tuple[float, float]]]:
    collectives: dict[tuple, list[tuple[int, float, float]]] = defaultdict(list)
    for e in document["traceEvents"]:
        if e.get("cat") != "plait.comm" or e["ph"] != "X":
            continue
        args = e["args"]
        if args.get("plait.comm.op") in ("send", "recv"):
            continue
        key = (
            args["plait.comm.group"],
            tuple(args["plait.comm.group_ranks"]),
            args["plait.comm.seq"],
        )
        collectives[key].append((e["pid"], e["ts"], e["ts"] + e["dur"]))
    waits: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for members in collectives.values():
        if len({pid for pid, _, _ in members}) < 2:
            continue
        last = max(start for _, start, _ in members)
        for pid, start, end in members:
            if start < last:
                waits[pid].append((start, min(last, end)))
    return waits
