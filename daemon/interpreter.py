"""How the daemon's process runs its interpreter: quick lock hand-overs, collections on a schedule.

    collect_garbage_less_often()   # every process that ingests spans (the daemon, its workers)
    with serving_interpreter():    # the daemon's own process, while it serves (`serve`)
        ...

Every call the daemon takes (an exporter's request, an ingest worker's reply, a query, a
stream) runs Python under one interpreter lock, so how that lock changes hands and how long the
collector holds it decide both the ingest rate and the query tail.

**Hand-overs.** A thread that wants the lock waits for the holder to release it, at the latest
after the switch interval (5 ms by default). A request back from an ingest worker, or a query,
then waits up to 5 ms per hand-over while the worker idles; `SWITCH_INTERVAL_SECONDS` (0.5 ms)
keeps the workers fed.

**Collections.** NOTE: the store keeps every rank's last spans (four GC-tracked containers
each) for as long as they are in its window. CPython's collector walks every tracked object of
the generation it collects, holding the lock, and it runs when allocations outnumber
deallocations by a threshold: with full windows every new span replaces an old one, so that
takes seconds, and by then the youngest generation holds every span stored since. A collection
then walked a million objects (150-260 ms; a full one 360-650 ms) and every call in flight waited
for it: the query p99 under ingest load (472-728 ms on a 16-core node, against 0.5 ms to compute
a GetMetrics answer). Collecting more often does not pay either: walking a span's objects once
costs ~1.3 µs, a sixth of what storing it costs. Nothing needs the collector: reference counting
frees every object the moment the daemon drops it, and ingest, queries and streams form no
reference cycles (`tests/daemon/test_interpreter.py` finds no garbage after them). So while the
daemon serves, `ScheduledCollections` turns automatic collection off and runs one full
collection every `FULL_COLLECTION_SECONDS`, for the odd cycle of an error path: one pause
every ten minutes (0.69 s with ten ranks' windows full, 500k spans, 1.9M tracked objects)
instead of pauses of hundreds of milliseconds every few seconds.

**Measured** (`tools/bench/daemon_load.py --ingest-workers 1 --flooders 3 --query-interval 1`:
32 clients querying every second, 2 cores, three alternating rounds): with both settings
84-91k spans/s stored, GetMetrics / GetBottleneck p99 175-212 / 96-110 ms, no collection;
with the interpreter's defaults 62-74k spans/s, 237-348 / 200-260 ms, a 181-251 ms collection
in each 10 s; with the hand-overs alone 83-90k spans/s, 300-333 / 85-285 ms.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Iterator

# How long a thread holds the interpreter lock before one waiting for it takes over.
SWITCH_INTERVAL_SECONDS = 0.0005
# The cyclic collector's first generation is collected after this many new container objects
# (CPython's default is 700).
INGEST_GC_THRESHOLD = 50_000
# How often the daemon collects reference cycles while it serves.
FULL_COLLECTION_SECONDS = 600.0


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


class ScheduledCollections:
    """While entered, automatic collection is off and every generation is collected once every
    `every_seconds` (on exit, automatic collection is as it was)."""

    def __init__(self, every_seconds: float = FULL_COLLECTION_SECONDS) -> None:
        if not every_seconds > 0:
            raise ValueError(f"every_seconds must be > 0, got {every_seconds}")
        self.every_seconds = every_seconds
        self.collections = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._was_enabled = True

    def _collect_on_schedule(self) -> None:
        while not self._stop.wait(self.every_seconds):
            gc.collect()
            self.collections += 1

    def __enter__(self) -> ScheduledCollections:
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._thread = threading.Thread(
            target=self._collect_on_schedule, name="plait-gc", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._was_enabled:
            gc.enable()


@contextlib.contextmanager
def serving_interpreter(
    *,
    switch_interval_seconds: float | None = SWITCH_INTERVAL_SECONDS,
    scheduled_collections: bool = True,
) -> Iterator[None]:
    """The daemon's process as it serves: quick hand-overs (None: the interpreter's own
    interval) and `ScheduledCollections` (unless told not to); both undone on exit."""
    previous = sys.getswitchinterval()
    if switch_interval_seconds is not None:
        sys.setswitchinterval(switch_interval_seconds)
    try:
        with ScheduledCollections() if scheduled_collections else contextlib.nullcontext():
            yield
    finally:
        sys.setswitchinterval(previous)
