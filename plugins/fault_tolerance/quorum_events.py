"""What a replica group saw of its quorum: joins, leaves, heals and failed commits, timed.

`QuorumWatch` turns the manager's answers step by step into `QuorumEvent`s; the telemetry side
sends them as spans, so the daemon (`plait status`) shows the replica groups of a job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
