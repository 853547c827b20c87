"""Identical queries that arrive together are answered by one computation, each answer fresh.

    answers = SharedAnswers()
    response = answers.get(("metrics", job_id, window), lambda: compute_metrics(job_id, window))

`plait top` streams, dashboards and scrapers ask the daemon the same question many times a
second; each answer walks every rank's window under the store's lock, which ingest needs too.
Here a request whose question is already being computed waits for that computation to end, then
shares the next one with every request that arrived meanwhile. So one computation per question
runs at a time, however many clients ask, and no answer is older than its request: the
computation a request shares starts after it arrived. When the daemon is quiet, a request
computes its own answer at once, as before. (A time-to-live cache would answer from before
the request: a client that exported, then asked, could miss its own spans.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Answer = TypeVar("Answer")


@dataclass(slots=True)
class _Computation(Generic[Answer]):
    """One computation and the requests that share it."""

    done: threading.Event = field(default_factory=threading.Event)
    answer: Answer | None = None
    error: BaseException | None = None
    sharers: int = 1

    def outcome(self) -> Answer:
        if self.error is not None:
            raise self.error
        return self.answer  # type: ignore[return-value]


@dataclass(slots=True)
class _Question(Generic[Answer]):
    running: _Computation[Answer] | None = None
    # Requests that arrived while `running` ran: they share the computation after it.
    next: _Computation[Answer] | None = None


class SharedAnswers(Generic[Answer]):
    """Single-flight answers per question key, fresh for every request (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._questions: dict[Hashable, _Question[Answer]] = {}
        self.computations = 0  # how many times an answer was computed
        self.requests = 0  # how many requests were answered

    def waiting(self, key: Hashable) -> int:
        """Requests for `key` waiting for the computation after the running one."""
        with self._lock:
            question = self._questions.get(key)
            return question.next.sharers if question and question.next else 0

    def get(self, key: Hashable, compute: Callable[[], Answer]) -> Answer:
        with self._lock:
            self.requests += 1
            question = self._questions.setdefault(key, _Question())
            if question.running is None:
                mine = question.running = _Computation()
                ahead = None
            elif question.next is None:
                mine, ahead = _Computation(), question.running
                question.next = mine
            else:
                question.next.sharers += 1
                follower = question.next
                mine = ahead = None
        if mine is None:  # another request leads the computation this one shares
            follower.done.wait()
            return follower.outcome()
        if ahead is not None:  # lead the next computation once the running one hands over
            ahead.done.wait()
        try:
            mine.answer = compute()
        except BaseException as error:  # every sharer sees the same failure
            mine.error = error
        finally:
            with self._lock:
                self.computations += 1
                # Hand over to the requests that arrived meanwhile (new ones queue behind
                # them); with none, forget the question.
                question.running, question.next = question.next, None
                if question.running is None:
                    self._questions.pop(key, None)
            mine.done.set()
        return mine.outcome()
