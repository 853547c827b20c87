"""What a replica group saw of its quorum: joins, leaves, heals and failed commits, timed.

`QuorumWatch` turns the manager's answers step by step into `QuorumEvent`s; the group's rank 0
publishes them on the core's span board (`publish_quorum_events`), and the telemetry plugin
sends each as a `plait.ft.quorum` span, so the daemon (`plait status`, the lighthouse's log of a
job) shows the replica groups of a job. Neither plugin imports the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from plait.core.span_board import BOARD, PublishedSpan, SpanBoard
from plait.daemon import telemetry_schema as names

EventKind = Literal["join", "leave", "heal", "failed_commit"]


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
    """An event with the id of the group that saw it at the lighthouse ("" unknown), as the
    telemetry sends it: one `plait.ft.quorum` span over the event's own time."""

    event: QuorumEvent
    replica_id: str = ""

    @property
    def always_sent(self) -> bool:
        return True  # rare, and what an operator reads a group's story from

    def spans(self, step: int) -> list[PublishedSpan]:
        del step  # an event carries its own step
        event = self.event
        return [
            PublishedSpan(
                name=names.QUORUM_EVENT_SPAN_NAME,
                start_ns=event.start_ns,
                end_ns=max(event.end_ns, event.start_ns),
                attributes=self.attributes(),
            )
        ]

    def attributes(self) -> dict[str, Any]:
        event = self.event
        attributes: dict[str, Any] = {
            names.SPAN_STEP: event.step,
            names.SPAN_QUORUM_EVENT: event.kind,
            names.SPAN_QUORUM_ID: event.quorum_id,
            names.SPAN_QUORUM_PARTICIPANTS: event.participants,
            names.SPAN_QUORUM_PREVIOUS: event.previous,
        }
        if event.detail:
            attributes[names.SPAN_QUORUM_DETAIL] = event.detail
        if self.replica_id:
            attributes[names.SPAN_REPLICA_ID] = self.replica_id
        return attributes


def publish_quorum_events(
    events: Iterable[QuorumEvent], *, replica_id: str = "", board: SpanBoard = BOARD
) -> None:
    """Publish a step's events for the telemetry (the group's rank 0 does, once)."""
    for event in events:
        board.publish(PublishedQuorumEvent(event, replica_id))


class QuorumWatch:
    """Compares each quorum with the last and collects the events between two `take()`s."""

    def __init__(self) -> None:
        self._participants = 0  # none before this group's first quorum
        self._events: list[QuorumEvent] = []
        self._healed_to: int | None = None

    def healed_to(self, step: int) -> None:
        """Called from the heal (torchft's quorum thread) with the step the peer's state is at."""
        self._healed_to = step

    def quorum(
        self, *, quorum_id: int, participants: int, step: int, start_ns: int, end_ns: int
    ) -> None:
        previous = self._participants
        if participants != previous:
            self._events.append(
                QuorumEvent(
                    kind="join" if participants > previous else "leave",
                    step=step,
                    quorum_id=quorum_id,
                    participants=participants,
                    previous=previous,
                    start_ns=start_ns,
                    end_ns=end_ns,
                )
            )
        self._participants = participants
        if self._healed_to is not None:
            self._events.append(
                QuorumEvent(
                    kind="heal",
                    step=self._healed_to,
                    quorum_id=quorum_id,
                    participants=participants,
                    previous=previous,
                    start_ns=start_ns,
                    end_ns=end_ns,
                    detail="from a live peer",
                )
            )
            self._healed_to = None

    def failed_commit(
        self,
        *,
        step: int,
        quorum_id: int,
        participants: int,
        start_ns: int,
        end_ns: int,
        error: str,
    ) -> None:
        self._events.append(
            QuorumEvent(
                kind="failed_commit",
                step=step,
                quorum_id=quorum_id,
                participants=participants,
                previous=participants,
                start_ns=start_ns,
                end_ns=end_ns,
                detail=error[:200],
            )
        )

    def take(self) -> tuple[QuorumEvent, ...]:
        events, self._events = tuple(self._events), []
        return events
