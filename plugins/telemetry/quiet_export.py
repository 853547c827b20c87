"""OpenTelemetry SDK exporters that fail quietly: one warning per rank for an unreachable
daemon, however many exports fail, and none of the OTLP exporter's per-batch error logs."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger("plait.telemetry")
OTLP_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"


class WarnOnce:
    """Logs one warning per rank for an unreachable daemon, however many exports fail."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._warned = threading.Event()

    def __call__(self, what: str) -> None:
        if not self._warned.is_set():
            self._warned.set()
            logger.warning(
                "plait telemetry: exporting %s to the daemon at %s failed; training continues "
                "and further failures are not reported",
                what,
                self.address,
            )


class DropEndpointLogs(logging.Filter):
    """Silences the OTLP exporter's per-batch error logs for our endpoint (we warn once)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__()
        self.endpoint = endpoint

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return self.endpoint not in args


class QuietSpanExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, warn: WarnOnce) -> None:
        self.inner, self.warn = inner, warn

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.inner.export(spans)
        if result is not SpanExportResult.SUCCESS:
            self.warn("spans")
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class QuietMetricExporter(MetricExporter):
    def __init__(self, inner: MetricExporter, warn: WarnOnce) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self.inner, self.warn = inner, warn

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        if result is not MetricExportResult.SUCCESS:
            self.warn("metrics")
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)
