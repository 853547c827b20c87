"""What a replica group saw of its quorum: joins, leaves, heals and failed commits, timed.

`QuorumWatch` turns the manager's answers step by step into `QuorumEvent`s (a core record,
`plait.core.quorum_events`); the telemetry plugin sends them as spans, so the daemon
(`plait status`) shows the replica groups of a job.
"""

from __future__ import annotations

from plait.core.quorum_events import QuorumEvent

__all__ = ["QuorumEvent", "QuorumWatch"]


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
