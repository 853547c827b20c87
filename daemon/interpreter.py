"""How the daemon's process runs its interpreter: quick lock hand-overs, brief collections.

    collect_garbage_less_often()   # every process that ingests spans (the daemon, its workers)
    with serving_interpreter():    # the daemon's own process, while it serves (`serve`)
        ...

Every call the daemon takes (an exporter's request, an ingest worker's reply, a query, a
stream) runs Python under one interpreter lock, so how that lock changes hands and how long the
collector holds it decide both the ingest rate and the query tail.

**Hand-overs.** A thread that wants the lock waits for the holder to release it, at the latest
after the switch interval (5 ms by default). A request back from an ingest worker, or a query,
then waits up to 5 ms per hand-over while the worker idles. `SWITCH_INTERVAL_SECONDS` (0.5 ms)
keeps the workers fed: 3 flooding exporters, 1 worker, 32 clients querying every second, 2
cores, alternating runs: 82-94k spans/s stored against 66-67k, GetMetrics p99 129-182 ms
against 232-325 ms, and fewer daemon CPU-µs per span (7.3-8.5 against 9.6-9.7).

**Collections.** NOTE: the store keeps every rank's last spans (three GC-tracked containers
each) for as long as they are in its window. CPython's collector walks every tracked object of
the generation it collects, holding the lock, and it runs when allocations outnumber
deallocations by a threshold: with full windows every new span replaces an old one, so that
takes seconds, and by then the youngest generation holds every span stored since. A collection
then walked a million objects (150-260 ms; a full one 360-650 ms) and every call in flight
waited for it: the query p99 under ingest load (472-728 ms on a 16-core node, against 0.5 ms to
compute a GetMetrics answer). `FreezeSurvivors` collects the youngest generation every
`YOUNG_COLLECTION_SECONDS` itself and moves what survives any collection to the permanent
generation (`gc.freeze()`), which the collector never walks: each collection walks only the
spans of the last fraction of a second (longest pause 22-40 ms against 186-258 ms in the runs
above). Frozen objects are still freed by reference counting the moment a window drops them.

The price: a reference cycle still alive at a collection and dropped later stays in memory until
the next full collection, which unfreezes everything first; it runs every
`FULL_COLLECTION_SECONDS` (one long pause an hour instead of one every few seconds). Ingest,
queries and streams form no cycles (`tests/daemon/test_interpreter.py` finds no garbage after
them), so that hour only waits for the odd cycle of an error path.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

# How long a thread holds the interpreter lock before one waiting for it takes over.
SWITCH_INTERVAL_SECONDS = 0.0005
# The cyclic collector's first generation is collected after this many new container objects
# (CPython's default is 700).
INGEST_GC_THRESHOLD = 50_000
# How often the youngest generation is collected (and its survivors frozen).
YOUNG_COLLECTION_SECONDS = 0.1
# How often everything frozen is unfrozen and collected once.
FULL_COLLECTION_SECONDS = 3600.0


def collect_garbage_less_often() -> None:
    """Raise the cyclic collector's first threshold for a process that ingests spans.

    NOTE: storing a span allocates a dozen small container objects (records, attribute dicts,
    interval tuples). With the default threshold the collector runs every ~60 spans: with five
    ranks' windows full, storing cost 31 CPU-µs per span against 17 with this threshold (same
    requests, same process). Never lowers a threshold set higher.
    """
    first, second, third = gc.get_threshold()
    if 0 < first < INGEST_GC_THRESHOLD:
        gc.set_threshold(INGEST_GC_THRESHOLD, max(second, 20), max(third, 100))


class FreezeSurvivors:
    """While entered, the youngest generation is collected every `young_collection_seconds`
    and what survives any collection is frozen; everything is unfrozen and collected once every
    `full_collection_seconds` (and on exit, unfrozen)."""

    def __init__(
        self,
        *,
        young_collection_seconds: float = YOUNG_COLLECTION_SECONDS,
        full_collection_seconds: float = FULL_COLLECTION_SECONDS,
    ) -> None:
        for name, seconds in (
            ("young_collection_seconds", young_collection_seconds),
            ("full_collection_seconds", full_collection_seconds),
        ):
            if not seconds > 0:
                raise ValueError(f"{name} must be > 0, got {seconds}")
        self.young_collection_seconds = young_collection_seconds
        self.full_collection_seconds = full_collection_seconds
        self.full_collections = 0
        self._collecting_all = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _after_collection(self, phase: str, info: dict[str, Any]) -> None:
        # Called by the collector with the GIL held; its own collection is over at "stop".
        if phase == "stop" and not self._collecting_all:
            gc.freeze()

    def collect_all(self) -> int:
        """Unfreeze, collect every generation, freeze the survivors; returns what was
        collected (the cycles that died while frozen)."""
        # A collection another thread triggers meanwhile must not freeze the heap again.
        self._collecting_all = True
        try:
            gc.unfreeze()
            collected = gc.collect()
        finally:
            self._collecting_all = False
        gc.freeze()
        self.full_collections += 1
        return collected

    def _collect_periodically(self) -> None:
        next_full = time.monotonic() + self.full_collection_seconds
        while not self._stop.wait(self.young_collection_seconds):
            if time.monotonic() >= next_full:
                self.collect_all()
                next_full = time.monotonic() + self.full_collection_seconds
            else:
                gc.collect(0)  # its survivors are frozen by `_after_collection`

    def __enter__(self) -> FreezeSurvivors:
        gc.callbacks.append(self._after_collection)
        gc.freeze()  # what the process holds before it serves: imports, the server, its threads
        self._thread = threading.Thread(
            target=self._collect_periodically, name="plait-gc", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        gc.callbacks.remove(self._after_collection)
        gc.unfreeze()


@contextlib.contextmanager
def serving_interpreter(
    *,
    switch_interval_seconds: float | None = SWITCH_INTERVAL_SECONDS,
    freeze_survivors: bool = True,
) -> Iterator[None]:
    """The daemon's process as it serves: quick hand-overs (None: the interpreter's own
    interval) and `FreezeSurvivors` (unless told not to); both undone on exit."""
    previous = sys.getswitchinterval()
    if switch_interval_seconds is not None:
        sys.setswitchinterval(switch_interval_seconds)
    try:
        with FreezeSurvivors() if freeze_survivors else contextlib.nullcontext():
            yield
    finally:
        sys.setswitchinterval(previous)
