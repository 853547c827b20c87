"""Collective-timeout reports: a timed-out op is named, with the ranks that never entered it.

A process-group timeout (`train.collective_timeout_seconds`) ends a blocked collective with a
backend error that says only that *this* rank waited too long ("Timed out waiting 3000ms for
recv operation", or NCCL's watchdog message). What an operator needs is the op and the ranks
that did not arrive. This `wrapper=True` `plait_communicate` plugin provides it:

- on every op it records, per group, how many group collectives this rank has entered and the
  last one's sequence number, op and purpose (one tuple stored in a dict: nothing on the wire);
- a background thread publishes that record to the job's c10d store about once a second, only
  when it changed. Publishing from the op path instead would cost a store round trip per op
  (`python -m plait.plugins.resilience.timeouts` measures both on this machine's store);
- when an op fails with a timeout — from the hook call for a synchronous op, from `wait()` for
  an asynchronous one (the returned `Work` is wrapped) — it reads the peers' records and raises
  `CollectiveTimeoutError` naming the op, group, sequence number and the ranks whose count shows
  they never entered it, chained to the backend's error.

On NCCL a timed-out op raises only with `TORCH_NCCL_BLOCKING_WAIT=1`; otherwise the watchdog
ends the process (its log names the op), and the published progress is still in the store.

Point-to-point ops are not matched by count (the two sides number their sends and receives
differently): a timed-out send or receive names its peer. Sub-ops of a communication algorithm
(purpose `algorithm/…`) are numbered by the algorithm; only the top-level op is counted.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
import weakref
from collections.abc import Generator, Mapping
from typing import Any, NamedTuple

import torch.distributed as dist

from plait.core.comm import CompletedWork, Work
from plait.core.errors import PlaitError
from plait.core.hookspecs import hookimpl
from plait.core.records import CommRequest

STORE_PREFIX = "plait/collective_progress"
PUBLISH_INTERVAL_SECONDS = 1.0
# At interpreter exit a publisher still running (its engine never closed) is stopped and waited
# for: a daemon thread inside a store call (C++, the GIL released) when Python finalizes is
# ended from the destructor that retakes the GIL, which aborts the process (SIGABRT).
EXIT_JOIN_SECONDS = 60.0
_TIMEOUT_WORDS = ("timed out", "timeout", "timing out")
_POINT_TO_POINT = ("send", "recv")

GroupKey = tuple[str, tuple[int, ...]]


class CollectiveTimeoutError(PlaitError):
    """A collective (or send/recv) timed out; names the op and the ranks that did not arrive."""

    def __init__(
        self,
        message: str,
        *,
        op: str,
        group: str,
        seq: int,
        missing_ranks: tuple[int, ...],
    ) -> None:
        super().__init__(message)
        self.op = op
        self.group = group
        self.seq = seq
        self.missing_ranks = missing_ranks


class Entered(NamedTuple):
    """The last group collective a rank entered on one group (a tuple: cheap on the op path)."""

    count: int  # group collectives entered so far on this group, this one included
    seq: int
    op: str
    purpose: str


def is_timeout(exc: BaseException) -> bool:
    """Gloo raises a RuntimeError saying it timed out; NCCL's watchdog a DistBackendError."""
    backend_error = getattr(dist, "DistBackendError", None)
    if backend_error is not None and isinstance(exc, backend_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in _TIMEOUT_WORDS)


def group_label(key: GroupKey) -> str:
    name, ranks = key
    return f"{name}[{','.join(map(str, ranks))}]"


class ReportingWork:
    """A `Work` whose `wait()` turns a backend timeout into a `CollectiveTimeoutError`."""

    __slots__ = ("_inner", "_reporter", "_request")

    def __init__(self, inner: Any, reporter: CollectiveTimeoutReporter, request: _OpSummary):
        self._inner = inner
        self._reporter = reporter
        self._request = request

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._inner.wait(*args, **kwargs)
        except Exception as exc:
            if not is_timeout(exc):
                raise
            raise self._reporter.timeout_error(self._request, exc) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _OpSummary(NamedTuple):
    """What a report needs of a request (not its tensors, which must not be kept alive)."""

    key: GroupKey
    op: str
    seq: int
    purpose: str
    peer: int | None
    count: int | None  # None for point-to-point and algorithm sub-ops


def _summary(request: CommRequest, key: GroupKey, count: int | None) -> _OpSummary:
    return _OpSummary(key, request.op, request.seq, request.purpose, request.peer, count)


class CollectiveTimeoutReporter:
    """The plugin object: progress per group, its publisher thread and the timeout reports.

    One per plugin manager (`make_plugin`), so per engine: every rank counts the same ops.
    """

    def __init__(
        self,
        *,
        publish_interval: float = PUBLISH_INTERVAL_SECONDS,
        store: Any = None,
        rank: int | None = None,
    ) -> None:
        """`store` and `rank` default to the default process group's store and this rank."""
        self.publish_interval = publish_interval
        self.timeout_seconds: float | None = None
        self._entered: dict[GroupKey, Entered] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Any = store
        self._rank = rank if rank is not None else 0
        self._version = 0
        self._published_version = -1

    # -- hooks --------------------------------------------------------------------------------

    @hookimpl
    def plait_configure(self, config: Any) -> None:
        self.timeout_seconds = float(config.train.collective_timeout_seconds)

    @hookimpl
    def plait_job_end(self) -> None:
        self.stop()

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: CommRequest) -> Generator[None, Work, Work]:
        key: GroupKey = (request.group_name, request.group_ranks)
        count = None
        if request.op not in _POINT_TO_POINT and "/" not in request.purpose:
            previous = self._entered.get(key)
            count = previous[0] + 1 if previous is not None else 1
            self._entered[key] = Entered(count, request.seq, request.op, request.purpose)
            self._version += 1
        if self._thread is None:
            self._start_publisher()
        try:
            work = yield
        except Exception as exc:
            if not is_timeout(exc):
                raise
            raise self.timeout_error(_summary(request, key, count), exc) from exc
        if not request.async_op or isinstance(work, CompletedWork):
            return work
        return ReportingWork(work, self, _summary(request, key, count))

    # -- publishing -----------------------------------------------------------------------------

    def _start_publisher(self) -> None:
        if self._store is None:
            if not dist.is_initialized() or dist.get_world_size() == 1:
                self._thread = threading.current_thread()  # nobody to tell: mark as started
                return
            try:
                self._store = dist.distributed_c10d._get_default_store()
            except (RuntimeError, ValueError):  # a group initialised without a store
                self._thread = threading.current_thread()
                return
            self._rank = dist.get_rank()
        self._stop.clear()
        self._publish()  # peers can tell "not arrived" from "never reported" from the start
        self._thread = threading.Thread(
            target=self._publish_loop, name="plait-collective-progress", daemon=True
        )
        self._thread.start()
        _stop_at_exit(self)

    def _publish_loop(self) -> None:
        while not self._stop.wait(self.publish_interval):
            if not self._publish():
                return

    def _publish(self) -> bool:
        """Write this rank's progress if it changed; False once the store is gone."""
        version = self._version
        if version == self._published_version:
            return True
        snapshot = dict(self._entered)  # one C-level copy, safe against the op path's writes
        payload = {
            group_label(key): [e.count, e.seq, e.op, e.purpose] for key, e in snapshot.items()
        }
        try:
            with self._lock:
                self._store.set(f"{STORE_PREFIX}/rank{self._rank}", json.dumps(payload))
        except Exception:  # the job is shutting down (store closed, its host gone)
            return False
        self._published_version = version
        return True

    def stop(self, join_seconds: float | None = None) -> None:
        """Stop publishing (waiting up to `join_seconds`, by default two intervals, for a
        publish in flight) and publish the final progress."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            wait = 2 * self.publish_interval if join_seconds is None else join_seconds
            thread.join(timeout=wait)
            if self._store is not None:
                self._publish()

    def peer_progress(self, ranks: tuple[int, ...]) -> dict[int, Mapping[str, list[Any]] | None]:
        """Each rank's last published progress (None if it never published)."""
        progress: dict[int, Mapping[str, list[Any]] | None] = {}
        for rank in ranks:
            key = f"{STORE_PREFIX}/rank{rank}"
            try:
                with self._lock:
                    published = self._store.check([key]) and self._store.get(key)
                progress[rank] = json.loads(published) if published else None
            except Exception:
                progress[rank] = None
        return progress

    # -- reports --------------------------------------------------------------------------------

    def timeout_error(self, op: _OpSummary, cause: BaseException) -> CollectiveTimeoutError:
        name, ranks = op.key
        label = group_label(op.key)
        limit = (
            f" after {self.timeout_seconds:g} s (train.collective_timeout_seconds)"
            if self.timeout_seconds is not None
            else ""
        )
        what = f"{op.op} seq {op.seq} (purpose {op.purpose}) on group {name!r} {list(ranks)}"
        if self._store is None:
            missing: tuple[int, ...] = ()
            detail = "no progress of other ranks is known (single process)"
        elif op.count is None:
            missing, detail = self._point_to_point(op, label)
        else:
            missing, detail = self._not_arrived(op, label)
        message = f"{what} timed out on rank {self._rank}{limit}: {detail}. Backend: {cause}"
        return CollectiveTimeoutError(
            message, op=op.op, group=name, seq=op.seq, missing_ranks=missing
        )

    def _not_arrived(self, op: _OpSummary, label: str) -> tuple[tuple[int, ...], str]:
        assert op.count is not None
        peers = [r for r in op.key[1] if r != self._rank]
        progress = self.peer_progress(tuple(peers))
        missing: list[int] = []
        lines: list[str] = []
        for rank in peers:
            entry = (progress.get(rank) or {}).get(label)
            if entry is None:
                missing.append(rank)
                lines.append(f"rank {rank} entered no collective on this group")
            elif entry[0] < op.count:
                missing.append(rank)
                lines.append(
                    f"rank {rank} last entered {entry[2]} seq {entry[1]} (purpose {entry[3]}), "
                    f"{op.count - entry[0]} collective(s) behind"
                )
        if not missing:
            return (), (
                "every rank of the group entered it (a peer may have failed inside it, or the "
                "transport is stuck)"
            )
        ranks = ", ".join(map(str, missing))
        return tuple(missing), f"rank(s) {ranks} did not arrive ({'; '.join(lines)})"

    def _point_to_point(self, op: _OpSummary, label: str) -> tuple[tuple[int, ...], str]:
        if op.peer is None:
            return (), "the op is part of a communication algorithm"
        entry = (self.peer_progress((op.peer,)).get(op.peer) or {}).get(label)
        where = (
            f"its last collective on this group was {entry[2]} seq {entry[1]}"
            if entry
            else "it entered no collective on this group"
        )
        return (op.peer,), f"peer rank {op.peer} did not complete the matching op ({where})"


_publishing: weakref.WeakSet[CollectiveTimeoutReporter] = weakref.WeakSet()


def _stop_at_exit(reporter: CollectiveTimeoutReporter) -> None:
    if not _publishing:
        atexit.unregister(_stop_publishers)
        atexit.register(_stop_publishers)
    _publishing.add(reporter)


def _stop_publishers() -> None:
    for reporter in list(_publishing):
        reporter.stop(join_seconds=EXIT_JOIN_SECONDS)


def make_plugin() -> CollectiveTimeoutReporter:
    """A fresh reporter per plugin manager (per engine)."""
    return CollectiveTimeoutReporter()


def _measure_store_set(store: Any, repeats: int = 2000) -> float:
    start = time.perf_counter()
    for i in range(repeats):
        store.set(f"{STORE_PREFIX}/measure", str(i))
    return (time.perf_counter() - start) / repeats


def _measure_dict_write(repeats: int = 200_000) -> float:
    entered: dict[GroupKey, Entered] = {}
    key: GroupKey = ("dp", (0, 1))
    start = time.perf_counter()
    for i in range(repeats):
        previous = entered.get(key)
        count = previous.count + 1 if previous is not None else 1
        entered[key] = Entered(count, i, "all_reduce", "grad_bucket")
    return (time.perf_counter() - start) / repeats


if __name__ == "__main__":
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        file_store = dist.FileStore(str(Path(tmp) / "store"), 1)
        tcp_store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        print(f"record per op (dict write):      {_measure_dict_write() * 1e6:8.2f} us")
        print(f"publish per op (FileStore.set):  {_measure_store_set(file_store) * 1e6:8.2f} us")
        print(f"publish per op (TCPStore.set):   {_measure_store_set(tcp_store) * 1e6:8.2f} us")
