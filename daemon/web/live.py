"""Server-sent events: one computation per interval, pushed to every open page.

A publisher thread builds the page's document every `interval` seconds (whether or not a page
is open, so the MFU history has no gaps) and hands the encoded event to each subscriber's queue.
A subscriber that falls behind (a slow browser) loses its oldest events, never the daemon's time:
the publisher never blocks on a page. Twenty pages cost twenty queue puts, not twenty analyses.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from plait.daemon.web.history import MfuHistory

logger = logging.getLogger(__name__)

SUBSCRIBER_BACKLOG = 8  # events a page may fall behind before its oldest are dropped
KEEPALIVE_SECONDS = 15.0  # a comment line keeps proxies from closing an idle stream


def sse_event(name: str, data: Any) -> bytes:
    """One event in the `text/event-stream` format (compact JSON: no newline inside `data`)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return f"event: {name}\ndata: {text}\n\n".encode()


class Publisher:
    """Computes the document every `interval` seconds and fans it out to subscribers."""

    def __init__(
        self,
        compute: Callable[[], dict[str, Any]],
        *,
        interval: float,
        history: MfuHistory,
    ) -> None:
        self._compute = compute
        self.interval = interval
        self.history = history
        self.latest: dict[str, Any] | None = None
        self.published = 0  # documents pushed so far (the page shows it; tests wait on it)
        self._subscribers: set[queue.Queue[bytes | None]] = set()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="plait-web-publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for subscriber in self._subscribers:
                _put_dropping_oldest(subscriber, None)  # ends each stream
            self._changed.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 5)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.publish(self._compute())
            except Exception:  # a bad figure must not end the page for good
                logger.exception("the web page's document could not be computed")
            self._stop.wait(self.interval)

    def publish(self, document: dict[str, Any]) -> None:
        sample = self.history.add(document)
        with self._lock:
            self.published += 1
            document = {**document, "sequence": self.published}
            self.latest = document
            event = sse_event("snapshot", {"document": document, "mfu": sample})
            for subscriber in self._subscribers:
                _put_dropping_oldest(subscriber, event)
            self._changed.notify_all()

    def wait_for_document(self, timeout: float) -> dict[str, Any] | None:
        """The latest document, waiting up to `timeout` for the first one."""
        with self._lock:
            self._changed.wait_for(lambda: self.latest is not None or self._stop.is_set(), timeout)
            return self.latest

    def stream(self) -> Iterator[bytes]:
        """The events one page receives: the history, the latest document, then every push
        (a keep-alive comment when idle) until the daemon stops."""
        subscriber: queue.Queue[bytes | None] = queue.Queue(maxsize=SUBSCRIBER_BACKLOG)
        with self._lock:
            self._subscribers.add(subscriber)
            history = self.history.samples()
            latest = self.latest
        try:
            yield sse_event("history", history)
            if latest is not None:
                yield sse_event("snapshot", {"document": latest, "mfu": None})
            while not self._stop.is_set():
                try:
                    event = subscriber.get(timeout=KEEPALIVE_SECONDS)
                except queue.Empty:
                    yield b": keep-alive\n\n"
                    continue
                if event is None:
                    return
                yield event
        finally:
            with self._lock:
                self._subscribers.discard(subscriber)

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._subscribers)


def _put_dropping_oldest(subscriber: queue.Queue[bytes | None], event: bytes | None) -> None:
    while True:
        try:
            subscriber.put_nowait(event)
            return
        except queue.Full:
            with contextlib.suppress(queue.Empty):
                subscriber.get_nowait()
