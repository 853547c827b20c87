"""Worker processes that parse and decode large trace requests: ingest on more than one core.

NOTE: reading a span costs the daemon ~10 µs of Python (the wire reader and the decoder), all
under one GIL, so a single daemon process stores 40-70k spans per second however many cores
the node has. Parsing and decoding need no store, so big requests go to worker processes (an
OpenTelemetry Collector spreads its receivers over cores the same way). A worker sends back the
decoded spans as compact bytes (`plait.daemon.ingest`) and the daemon only stores them: 2.7 µs
per span on an idle core against 12.4 µs for the worker's part (`tools/bench/daemon_load.py
--ingest-workers N` measures both under load).

Requests under `offload_bytes` are decoded in the daemon: for a few spans the round trip costs
more than the decoding. A worker that dies is replaced and its request decoded in the daemon,
so no request is lost to a crashed worker. Workers are spawned (never forked: the daemon's gRPC
threads may hold locks at that moment) and exit when the daemon closes their pipe or dies.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from google.protobuf.message import DecodeError

from plait.daemon.config import DEFAULT_INGEST_OFFLOAD_BYTES
from plait.daemon.decoder import StaticsCache
from plait.daemon.ingest import (
    DecodedResource,
    decode_resources,
    decode_wire,
    encode_resources,
)
from plait.daemon.interpreter import collect_garbage_less_often
from plait.daemon.otlp_requests import trace_request_parser

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_SECONDS = 60.0
# Longest a request waits for a free worker before the daemon decodes it itself.
WAIT_FOR_WORKER_SECONDS = 10.0

# A worker's reply: these prefixes, then the decoded request or the error's text.
_DECODED, _MALFORMED, _FAILED = b"D", b"M", b"F"


class WorkerLost(RuntimeError):
    """No worker decoded the request: the one given it died or failed, or none came free."""


def _work(conn: Connection) -> None:
    """A worker's loop: request bytes in, decoded spans (or why not) out, until EOF."""
    collect_garbage_less_often()
    parse, statics = trace_request_parser(), StaticsCache()
    conn.send_bytes(_DECODED)  # ready
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            decoded = decode_resources(parse(data).resources, statics, for_wire=True)
            reply = _DECODED + encode_resources(decoded)
        except DecodeError as exc:  # malformed bytes: the daemon answers INVALID_ARGUMENT
            reply = _MALFORMED + str(exc).encode()
        except Exception as exc:  # a bug in decoding must not take the worker down
            reply = _FAILED + f"{type(exc).__name__}: {exc}".encode()
        conn.send_bytes(reply)


@dataclass
class _Worker:
    process: Any  # multiprocessing.Process (spawn context)
    conn: Connection


@dataclass
class PoolStats:
    """What `Status` shows of the pool."""

    workers: int
    decoded_requests: int
    restarts: int


class IngestPool:
    """`workers` processes decoding trace requests of at least `offload_bytes` bytes."""

    def __init__(self, workers: int, *, offload_bytes: int = DEFAULT_INGEST_OFFLOAD_BYTES) -> None:
        if workers < 1:
            raise ValueError(f"an ingest pool needs at least 1 worker, got {workers}")
        self.offload_bytes = offload_bytes
        self._context = mp.get_context("spawn")
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        self._closed = False
        self.decoded_requests = 0
        self.restarts = 0
        started = [self._spawn() for _ in range(workers)]
        for worker in started:
            self._wait_ready(worker)
            self._idle.put(worker)

    def _spawn(self) -> _Worker:
        parent, child = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_work, args=(child,), name="plait-ingest", daemon=True
        )
        process.start()
        child.close()  # the worker's end lives in the worker; EOF here when it dies
        worker = _Worker(process, parent)
        with self._lock:
            self._all.append(worker)
        return worker

    def _wait_ready(self, worker: _Worker) -> None:
        if not worker.conn.poll(STARTUP_TIMEOUT_SECONDS) or worker.conn.recv_bytes() != _DECODED:
            raise RuntimeError("an ingest worker did not start")

    def takes(self, data: bytes) -> bool:
        """Whether a request of this size goes to a worker (never once none is left)."""
        return not self._closed and bool(self._all) and len(data) >= self.offload_bytes

    def decode(self, data: bytes) -> list[DecodedResource]:
        """The request decoded by a worker.

        Raises `DecodeError` for malformed bytes (as protobuf would in the daemon),
        `WorkerLost` when the worker died on it (it is replaced) or none came free in time:
        the caller decodes the request itself."""
        try:  # waits without the GIL
            worker = self._idle.get(timeout=WAIT_FOR_WORKER_SECONDS)
        except queue.Empty:
            raise WorkerLost("no ingest worker came free") from None
        try:
            worker.conn.send_bytes(data)
            reply = worker.conn.recv_bytes()
        except (EOFError, OSError) as exc:
            self._replace(worker)
            raise WorkerLost(f"ingest worker {worker.process.pid} died: {exc!r}") from exc
        self._idle.put(worker)
        kind, body = reply[:1], reply[1:]
        if kind == _MALFORMED:
            raise DecodeError(body.decode(errors="replace"))
        if kind == _FAILED:
            raise WorkerLost(f"ingest worker failed: {body.decode(errors='replace')}")
        try:
            decoded = decode_wire(body)
        except ValueError as exc:  # a worker started from other code (plait upgraded since)
            raise WorkerLost(f"ingest worker answered in another format: {exc}") from exc
        with self._lock:
            self.decoded_requests += 1
        return decoded

    def _replace(self, worker: _Worker) -> None:
        worker.conn.close()
        worker.process.join(timeout=1.0)
        with self._lock:
            self._all.remove(worker)
            self.restarts += 1
            closed = self._closed
        log.warning(
            "ingest worker %s exited (code %s); starting another",
            worker.process.pid,
            worker.process.exitcode,
        )
        if closed:
            return
        fresh = None
        try:
            fresh = self._spawn()
            self._wait_ready(fresh)
        except (OSError, RuntimeError) as exc:
            # One worker fewer (none left: `takes` sends every request to the daemon's decoder).
            log.error("could not replace an ingest worker: %s", exc)
            if fresh is not None:
                fresh.process.kill()
                with self._lock:
                    self._all.remove(fresh)
            return
        self._idle.put(fresh)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(len(self._all), self.decoded_requests, self.restarts)

    def close(self, timeout: float = 5.0) -> None:
        """Stop every worker: their pipes close, they exit; stragglers are terminated."""
        with self._lock:
            self._closed = True
            workers = list(self._all)
        for worker in workers:
            worker.conn.close()
        for worker in workers:
            worker.process.join(timeout)
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(timeout)
