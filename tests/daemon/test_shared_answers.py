"""Identical concurrent queries share one computation, and no answer predates its request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from plait.daemon.shared_answers import SharedAnswers

WAIT = 30.0  # seconds any step below may take before the test gives up


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "the requests never queued"
        time.sleep(0.001)


def test_requests_arriving_during_a_computation_share_the_next_one() -> None:
    answers: SharedAnswers[int] = SharedAnswers()
    state = {"version": 1}
    first_started, release_first = threading.Event(), threading.Event()
    results: dict[str, int] = {}

    def first() -> int:
        seen = state["version"]
        first_started.set()
        assert release_first.wait(WAIT)
        return seen

    def later() -> int:
        return state["version"]

    threads = {"a": threading.Thread(target=lambda: results.update(a=answers.get("q", first)))}
    threads["a"].start()
    assert first_started.wait(WAIT)
    state["version"] = 2  # written after the running computation read the state...
    for name in ("b", "c"):  # ...and before these requests arrive
        threads[name] = threading.Thread(
            target=lambda name=name: results.update({name: answers.get("q", later)})
        )
        threads[name].start()
    _until(lambda: answers.waiting("q") == 2)
    release_first.set()
    for thread in threads.values():
        thread.join(WAIT)
    # b and c did not take a's answer, computed before the write they came after.
    assert results == {"a": 1, "b": 2, "c": 2}
    assert (answers.computations, answers.requests) == (2, 3)


def test_a_quiet_daemon_computes_every_answer_at_once() -> None:
    answers: SharedAnswers[int] = SharedAnswers()
    counter = iter(range(100))
    assert [answers.get("q", lambda: next(counter)) for _ in range(3)] == [0, 1, 2]
    assert answers.get("other", lambda: 42) == 42
    assert answers.computations == 4 and answers.waiting("q") == 0


def test_a_failure_reaches_every_request_that_shared_it() -> None:
    answers: SharedAnswers[int] = SharedAnswers()
    started, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def blocked() -> int:
        started.set()
        assert release.wait(WAIT)
        return 0

    def broken() -> int:
        raise ValueError("window gone")

    def ask(compute: Callable[[], int]) -> None:
        try:
            answers.get("q", compute)
        except ValueError as error:
            errors.append(error)

    leader = threading.Thread(target=ask, args=(blocked,))
    leader.start()
    assert started.wait(WAIT)
    sharers = [threading.Thread(target=ask, args=(broken,)) for _ in range(3)]
    for thread in sharers:
        thread.start()
    _until(lambda: answers.waiting("q") == 3)
    release.set()
    for thread in (leader, *sharers):
        thread.join(WAIT)
    assert len(errors) == 3 and len({id(e) for e in errors}) == 1
    # The question is forgotten once nobody asks it: the next request computes afresh.
    assert answers.get("q", lambda: 7) == 7


def test_different_questions_do_not_wait_for_each_other() -> None:
    answers: SharedAnswers[str] = SharedAnswers()
    started, release = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        assert release.wait(WAIT)
        return "slow"

    thread = threading.Thread(target=answers.get, args=("one", slow))
    thread.start()
    assert started.wait(WAIT)
    assert answers.get("two", lambda: "fast") == "fast"  # while "one" is still computing
    release.set()
    thread.join(WAIT)


@pytest.mark.parametrize("clients", [16])
def test_many_clients_at_once_all_get_an_answer(clients: int) -> None:
    answers: SharedAnswers[int] = SharedAnswers()
    results: list[int] = []
    barrier = threading.Barrier(clients)

    def client() -> None:
        barrier.wait(WAIT)
        for _ in range(20):
            results.append(answers.get("q", lambda: 1))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert results == [1] * clients * 20
    assert answers.requests == clients * 20 and answers.computations <= answers.requests
