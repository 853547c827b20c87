"""A rank's stacks, taken from another thread: every thread, outermost frame first, the whole
chain even where walking `f_back` stops short (faulthandler's walk is the check)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from plait.plugins.telemetry import stacks


def parked_in_a_generator(release: threading.Event, parked: threading.Event) -> None:
    """Blocked inside a generator expression, as `any(rt.skip_step() for …)` is in a step."""
    any(wait_here(release, parked) for _ in range(1))


def wait_here(release: threading.Event, parked: threading.Event) -> bool:
    parked.set()
    release.wait()
    return False


@pytest.fixture
def blocked() -> Iterator[threading.Thread]:
    release, parked = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=parked_in_a_generator, args=(release, parked), name="trainer", daemon=True
    )
    thread.start()
    assert parked.wait(30)
    yield thread
    release.set()
    thread.join(timeout=30)


def _functions(document: dict, name: str) -> list[str]:
    (thread,) = [t for t in document["threads"] if t["name"] == name]
    return [f["function"] for f in thread["frames"]]


def test_every_thread_outermost_first_with_source_lines(blocked: threading.Thread) -> None:
    document = stacks.thread_stacks(training_thread=blocked.ident, step=4)
    (trainer,) = [t for t in document["threads"] if t["training"]]
    functions = [f["function"] for f in trainer["frames"]]
    assert functions[0] == "_bootstrap" and functions[-1] == "wait"
    assert functions[-5:-2] == ["parked_in_a_generator", "<genexpr>", "wait_here"]
    assert trainer["frames"][-3]["code"] == "release.wait()"
    assert document["step"] == 4 and trainer["name"] == "trainer"
    assert threading.get_ident() not in {t["thread_id"] for t in document["threads"]}


def test_a_chain_cut_short_is_taken_from_faulthandler(
    blocked: threading.Thread, monkeypatch: pytest.MonkeyPatch
) -> None:
    walk = stacks._walked
    # The gap seen in a live run: the walk stops at the generator expression.
    monkeypatch.setattr(stacks, "_walked", lambda frame: walk(frame)[-4:])
    functions = _functions(stacks.thread_stacks(training_thread=None, step=0), "trainer")
    assert functions[0] == "_bootstrap" and "parked_in_a_generator" in functions
    assert functions[-1] == "wait"


def test_faulthandler_stacks_name_threads_by_their_id(blocked: threading.Thread) -> None:
    found = stacks.faulthandler_stacks()
    frames = found[blocked.ident]
    assert [f["function"] for f in frames][-3:-1] == ["wait_here", "wait"]
    assert frames[-3]["code"] == "release.wait()"


def test_a_chain_cut_at_a_generator_expression_is_taken_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The two walks race the running thread: a chain cut at a generator expression's gap
    (and no longer in faulthandler's walk) is retaken until it reaches the thread's start."""

    def chain(*functions: str) -> list[dict[str, object]]:
        return [{"file": "f.py", "line": 1, "function": f, "code": ""} for f in functions]

    cut = [{"thread_id": 1, "name": "t", "training": True, "daemon": False,
            "frames": chain("<genexpr>", "skip_step", "all_reduce")}]  # fmt: skip
    whole = [{**cut[0], "frames": chain("<module>", "run_training", "<genexpr>", "skip_step")}]
    snapshots = iter([cut, cut, whole])
    monkeypatch.setattr(stacks, "_snapshot", lambda training_thread: next(snapshots))
    taken = stacks.thread_stacks(training_thread=1, step=0)
    assert [f["function"] for f in taken["threads"][0]["frames"]][:2] == [
        "<module>",
        "run_training",
    ]

    calls = []
    monkeypatch.setattr(stacks, "_snapshot", lambda training_thread: calls.append(1) or cut)
    stacks.thread_stacks(training_thread=1, step=0)
    assert len(calls) == stacks.SNAPSHOT_TRIES  # bounded: a thread stuck in the gap still answers
