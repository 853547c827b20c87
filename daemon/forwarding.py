"""Forwarding upstream like an OpenTelemetry Collector's exporter: a bounded queue with retry.

Received OTLP requests are queued as they are (after the decoder removed rejected items) and
sent in order by one thread. The queue is bounded by requests *and* bytes, so a dead upstream
costs at most `max_bytes` of memory; a request that does not fit is dropped and counted.

Retries follow the OTLP/gRPC specification ("Failures" and "Throttling"):

* UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, ABORTED, OUT_OF_RANGE and DATA_LOSS are retried
  with exponential backoff (with jitter), until `max_elapsed_seconds` have passed since the
  first attempt;
* RESOURCE_EXHAUSTED is retried only when the server attaches `google.rpc.RetryInfo`, after the
  delay it asks for; without it the server cannot recover (e.g. a request over its size limit),
  and the request is dropped;
* every other status is permanent: the request is dropped and counted by status;
* a response with `partial_success` is a success: the rejected items are counted, never resent.

NOTE: the SDK's OTLP exporters retry in their own `export()` call; this is a separate queue so a
slow upstream never blocks the receivers, and its drops show in `plait status`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.rpc.error_details_pb2 import RetryInfo

logger = logging.getLogger(__name__)

RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.DATA_LOSS,
    }
)
RETRY_INFO_KEY = "google.rpc.retryinfo-bin"
DEFAULT_MAX_REQUESTS = 1024
DEFAULT_MAX_BYTES = 64 * 2**20
DEFAULT_SEND_TIMEOUT_SECONDS = 5.0
FAILURE_LOG_SECONDS = 60.0

DROP_QUEUE_FULL = "queue full"
DROP_RETRIES_EXHAUSTED = "retries exhausted"
DROP_SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff: initial, ×multiplier each time, capped, ±jitter, for max_elapsed."""

    initial_backoff_seconds: float = 0.5
    max_backoff_seconds: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2
    max_elapsed_seconds: float = 60.0

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after the `attempt`-th failure (1-based)."""
        # The exponent is capped so a long outage cannot overflow the float.
        base = self.initial_backoff_seconds * self.multiplier ** min(attempt - 1, 60)
        base = min(base, self.max_backoff_seconds)
        return base * random.uniform(1.0 - self.jitter, 1.0 + self.jitter)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One queued request: the stub method, the message, its size and what it carries."""

    call: Callable[..., Any]
    request: Any
    metadata: tuple[tuple[str, str], ...]
    nbytes: int
    spans: int = 0
    metric_points: int = 0


@dataclass
class ForwarderStats:
    """Counters of one forwarder (read under its lock; `snapshot` copies them)."""

    queued_requests: int = 0
    queued_bytes: int = 0
    capacity_bytes: int = 0
    forwarded_requests: int = 0
    retries: int = 0
    dropped_requests: int = 0
    dropped_spans: int = 0
    dropped_metric_points: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    rejected_upstream_items: int = 0


def retry_delay(error: grpc.RpcError) -> float | None:
    """The delay a server asks for in `google.rpc.RetryInfo` trailing metadata, if any."""
    trailing = getattr(error, "trailing_metadata", None)
    metadata = dict(trailing() or ()) if callable(trailing) else {}
    raw = metadata.get(RETRY_INFO_KEY)
    if raw is None:
        return None
    info = RetryInfo()
    try:
        info.ParseFromString(raw)
    except Exception:  # a malformed RetryInfo is no permission to retry
        return None
    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9


def retry_after(error: grpc.RpcError, attempt: int, policy: RetryPolicy) -> float | None:
    """Seconds to wait before retrying after `error`, or None when it must not be retried."""
    code = error.code() if hasattr(error, "code") else None
    if code in RETRYABLE_CODES:
        delay = retry_delay(error)
        return delay if delay is not None else policy.backoff(attempt)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return retry_delay(error)
    return None


def rejected_items(response: Any) -> int:
    """Items an OTLP response's partial success says were rejected (0 for full success)."""
    partial = getattr(response, "partial_success", None)
    if partial is None:
        return 0
    return int(getattr(partial, "rejected_spans", 0) or getattr(partial, "rejected_data_points", 0))


class Forwarder:
    """A bounded, ordered send queue drained by one thread, with OTLP retry rules."""

    def __init__(
        self,
        describe: str,
        *,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        policy: RetryPolicy | None = None,
        send_timeout_seconds: float = DEFAULT_SEND_TIMEOUT_SECONDS,
    ) -> None:
        self.describe = describe
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.policy = policy or RetryPolicy()
        self.send_timeout_seconds = send_timeout_seconds
        self.stats = ForwarderStats(capacity_bytes=max_bytes)
        self._queue: deque[Outgoing] = deque()
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._flush_deadline = float("inf")
        self._last_failure_log = 0.0
        self._thread = threading.Thread(target=self._drain, name="plait-otlp-forward", daemon=True)

    # -- producer side -------------------------------------------------------------------------

    def put(self, item: Outgoing) -> bool:
        """Queue `item`; False (and counted) when the queue is full or stopping."""
        with self._lock:
            stats = self.stats
            full = (
                stats.queued_requests + 1 > self.max_requests
                or stats.queued_bytes + item.nbytes > self.max_bytes
            )
            if full or self._stop.is_set():
                self._count_drop(item, DROP_SHUTDOWN if self._stop.is_set() else DROP_QUEUE_FULL)
                return False
            self._queue.append(item)
            stats.queued_requests += 1
            stats.queued_bytes += item.nbytes
            self._lock.notify()
            return True

    def snapshot(self) -> ForwarderStats:
        with self._lock:
            s = self.stats
            return ForwarderStats(
                queued_requests=s.queued_requests,
                queued_bytes=s.queued_bytes,
                capacity_bytes=s.capacity_bytes,
                forwarded_requests=s.forwarded_requests,
                retries=s.retries,
                dropped_requests=s.dropped_requests,
                dropped_spans=s.dropped_spans,
                dropped_metric_points=s.dropped_metric_points,
                dropped_by_reason=dict(s.dropped_by_reason),
                rejected_upstream_items=s.rejected_upstream_items,
            )

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, flush_seconds: float) -> None:
        """Send what is queued for at most `flush_seconds` more, then drop the rest."""
        with self._lock:
            self._flush_deadline = time.monotonic() + flush_seconds
            self._stop.set()
            self._lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=flush_seconds + self.send_timeout_seconds + 1)
        with self._lock:
            while self._queue:
                self._count_drop(self._dequeue(), DROP_SHUTDOWN)

    # -- the sending thread --------------------------------------------------------------------

    def _count_drop(self, item: Outgoing, reason: str) -> None:
        stats = self.stats
        stats.dropped_requests += 1
        stats.dropped_spans += item.spans
        stats.dropped_metric_points += item.metric_points
        stats.dropped_by_reason[reason] = stats.dropped_by_reason.get(reason, 0) + 1

    def _dequeue(self) -> Outgoing:
        item = self._queue.popleft()
        self.stats.queued_requests -= 1
        self.stats.queued_bytes -= item.nbytes
        return item

    def _drain(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stop.is_set():
                    self._lock.wait()
                if not self._queue:
                    return
                item = self._queue[0]
            try:
                outcome = self._deliver(item)
            except Exception:  # never let one request end forwarding for good
                logger.exception("forwarding to %s failed unexpectedly", self.describe)
                outcome = "error"
            with self._lock:
                self._dequeue()
                if outcome is None:
                    self.stats.forwarded_requests += 1
                else:
                    self._count_drop(item, outcome)

    def _deliver(self, item: Outgoing) -> str | None:
        """Send `item`, retrying as the spec allows; None when delivered, else the drop reason."""
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            remaining = self._flush_deadline - time.monotonic()
            if remaining <= 0:
                return DROP_SHUTDOWN
            try:
                response = item.call(
                    item.request,
                    timeout=min(self.send_timeout_seconds, remaining),
                    metadata=item.metadata,
                )
            except grpc.RpcError as error:
                wait = retry_after(error, attempt, self.policy)
                self._log_failure(error)
                if wait is None:
                    code = error.code() if hasattr(error, "code") else None
                    return f"rejected upstream: {code.name if code else 'ERROR'}"
                elapsed = time.monotonic() - started
                if elapsed + wait > self.policy.max_elapsed_seconds:
                    return DROP_RETRIES_EXHAUSTED
                with self._lock:
                    self.stats.retries += 1
                if self._stop.is_set():  # flushing: back off too, within the deadline
                    time.sleep(max(min(wait, self._flush_deadline - time.monotonic()), 0))
                else:  # woken early by stop(), which then bounds the rest by its deadline
                    self._stop.wait(wait)
                continue
            rejected = rejected_items(response)
            if rejected:
                with self._lock:
                    self.stats.rejected_upstream_items += rejected
            return None

    def _log_failure(self, error: grpc.RpcError) -> None:
        now = time.monotonic()
        if now - self._last_failure_log > FAILURE_LOG_SECONDS:
            self._last_failure_log = now
            logger.warning(
                "forwarding to %s failed (retrying if allowed): %s", self.describe, error
            )


def count_items(request: Any) -> tuple[int, int]:
    """(spans, metric data points) in an OTLP export request."""
    spans = points = 0
    for resource in getattr(request, "resource_spans", ()):
        spans += sum(len(scope.spans) for scope in resource.scope_spans)
    for resource in getattr(request, "resource_metrics", ()):
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                which = metric.WhichOneof("data")
                points += len(getattr(metric, which).data_points) if which else 0
    return spans, points


def outgoing(
    call: Callable[..., Any], request: Any, metadata: Sequence[tuple[str, str]]
) -> Outgoing:
    spans, points = count_items(request)
    return Outgoing(
        call=call,
        request=request,
        metadata=tuple(metadata),
        nbytes=request.ByteSize(),
        spans=spans,
        metric_points=points,
    )
