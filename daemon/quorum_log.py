"""What a fault-tolerant job's replica groups reported of their quorum: a bounded event list.

Each replica group's rank 0 sends one `plait.ft.quorum` span per join, leave, heal or failed
commit it saw (`plait.plugins.fault_tolerance.quorum_events`). The store keeps, per job, the last
`MAX_QUORUM_EVENTS` of them in the order they started, and per group the last one it sent
(its replica id at the lighthouse, the quorum id and participants it last saw). Which groups
participate is decided by the analysis (`plait.daemon.replica_groups`), from the groups' ranks.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from plait.daemon.decoder import QuorumFigures

MAX_QUORUM_EVENTS = 256  # per job; older events are only counted


@dataclass(frozen=True, slots=True)
class QuorumEventRecord:
    """One event as the daemon keeps it: the group that saw it, its step, its time."""

    replica_group: int
    figures: QuorumFigures
    step: int  # the wire step (0-based)
    start_ns: int
    end_ns: int

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclass
class QuorumLog:
    """One job's quorum events, oldest first, and each group's last one."""

    events: list[QuorumEventRecord] = field(default_factory=list)
    events_received: int = 0
    last_by_group: dict[int, QuorumEventRecord] = field(default_factory=dict)

    def add(self, event: QuorumEventRecord) -> None:
        # Groups' spans arrive in batches of their own: keep the list in start order.
        keys = [(e.start_ns, e.replica_group) for e in self.events]
        index = bisect.bisect_right(keys, (event.start_ns, event.replica_group))
        self.events.insert(index, event)
        del self.events[:-MAX_QUORUM_EVENTS]
        self.events_received += 1
        last = self.last_by_group.get(event.replica_group)
        if last is None or (last.figures.quorum_id, last.start_ns) <= (
            event.figures.quorum_id,
            event.start_ns,
        ):
            self.last_by_group[event.replica_group] = event
