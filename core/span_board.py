"""Spans a feature publishes for the telemetry to send, without either importing the other.

A feature with something to report beside the step — a MoE model's expert load (the expert-parallel
plugin), a fault-tolerant group's joins, leaves and heals (fault tolerance) — publishes a
`SpanSource` on `BOARD`. The telemetry plugin takes what was published at each step boundary and
at the end of the job, and its exporter thread asks each source for its spans: a source may wait
there for its device-to-host copies, never on the training thread. The names and attributes are
the daemon's (`plait.daemon.telemetry_schema`); the source's owner chooses them.

    BOARD.publish(ExpertLoadSource(...))     # the feature, on the training thread
    for source in BOARD.take():              # the telemetry plugin
        exporter.put_published(source, step)

With nobody taking (telemetry off) the oldest sources fall off.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# Sources waiting for a telemetry plugin to take them.
MAX_PENDING_SOURCES = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishedSpan:
    """One span as its owner describes it (`end_ns == start_ns`: an instant)."""

    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]


class SpanSource(Protocol):
    """What a feature publishes: spans, resolved on the exporter's thread."""

    @property
    def always_sent(self) -> bool:
        """True: never dropped when the exporter's queue is full (rare records an operator
        reads a story from); False: dropped and counted like a step's records."""
        ...

    def spans(self, step: int) -> Sequence[PublishedSpan]:
        """The spans to send. `step`: the step the telemetry was at when it took this source
        (the one starting or just ended; -1 before the first), for a source that does not know
        its own step."""
        ...


class SpanBoard:
    """Sources published by features, taken (once) by the telemetry."""

    def __init__(self, capacity: int = MAX_PENDING_SOURCES) -> None:
        self._lock = threading.Lock()
        self._pending: deque[SpanSource] = deque(maxlen=capacity)

    def publish(self, source: SpanSource) -> None:
        with self._lock:
            self._pending.append(source)

    def take(self) -> list[SpanSource]:
        """Everything published since the last take, oldest first."""
        with self._lock:
            taken = list(self._pending)
            self._pending.clear()
        return taken


# The process's board: one training job per process publishes here.
BOARD = SpanBoard()
