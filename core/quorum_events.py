"""A fault-tolerant job's quorum events, and the board that carries them to the telemetry.

The fault-tolerance plugin observes the events (`plait.plugins.fault_tolerance.quorum_events`
turns the manager's answers into `QuorumEvent`s); the telemetry plugin sends them to the node's
daemon as `plait.ft.quorum` spans. Neither imports the other: whoever holds a step's events (the
trainer, on the group's rank 0) publishes them on `BOARD`, and the telemetry plugin takes them at
the next step boundary and queues them on its exporter.

    BOARD.publish(outcome.events, replica_id="job-group1:1f0e…")
    for published in BOARD.take():  # in the telemetry plugin
        exporter.put_quorum_event(published)
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

EventKind = Literal["join", "leave", "heal", "failed_commit"]
# Events waiting for a telemetry plugin to take them; older ones fall off (a run without
# telemetry publishes and nobody takes).
MAX_PENDING_EVENTS = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class QuorumEvent:
    """One change of a job's replica groups, as one group saw it.

    `join`/`leave`: the quorum grew/shrank (`participants` after it, `previous` before), timed
    over the quorum request. `heal`: this group took a live peer's state, timed over the quorum
    that carried it, `step` the step it healed to. `failed_commit`: the step was tried and not
    committed, timed over the try."""

    kind: EventKind
    step: int
    quorum_id: int
    participants: int
    previous: int
    start_ns: int
    end_ns: int
    detail: str = ""

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    def describe(self) -> str:
        """One line for a log: what happened, at which step, how long it took."""
        groups = f"{self.previous} -> {self.participants} replica groups"
        what = {
            "join": f"a replica group joined ({groups})",
            "leave": f"a replica group left ({groups})",
            "heal": f"healed {self.detail} to step {self.step}",
            "failed_commit": f"step {self.step} not committed ({self.detail}); retrying",
        }[self.kind]
        return f"quorum {self.quorum_id}: {what} in {self.seconds:.2f}s"


@dataclass(frozen=True, slots=True)
class PublishedQuorumEvent:
    """An event with the id of the group that saw it at the lighthouse ("" unknown)."""

    event: QuorumEvent
    replica_id: str = ""


class QuorumEventBoard:
    """Events published by the fault-tolerant steps' owner, taken (once) by the reporter."""

    def __init__(self, capacity: int = MAX_PENDING_EVENTS) -> None:
        self._lock = threading.Lock()
        self._pending: deque[PublishedQuorumEvent] = deque(maxlen=capacity)

    def publish(self, events: Iterable[QuorumEvent], *, replica_id: str = "") -> None:
        with self._lock:
            self._pending.extend(PublishedQuorumEvent(e, replica_id) for e in events)

    def take(self) -> list[PublishedQuorumEvent]:
        """Everything published since the last take, oldest first."""
        with self._lock:
            taken = list(self._pending)
            self._pending.clear()
        return taken


BOARD = QuorumEventBoard()
