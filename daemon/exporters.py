"""Exporters: forward upstream over OTLP, and serve Prometheus text.

**OTLP upstream** (`OtlpUpstream`): every request the ranks export is forwarded as received
(the daemon is a pass-through hop, like an OpenTelemetry Collector's OTLP exporter), through a
bounded queue drained by one thread; a full queue drops the request and counts it. The daemon's
own figures (per-rank and per-job MFU, bottleneck classes, straggler scores, NVML `hw.*`
metrics, ingest counters) go through the OpenTelemetry SDK's OTLP metric exporter, and each
detected hang as a span with a `hang.detected` event through its span exporter. The endpoint
and its settings follow the OpenTelemetry exporter variables, `OTEL_EXPORTER_OTLP_ENDPOINT`
(or `…_TRACES_ENDPOINT` / `…_METRICS_ENDPOINT`), `…_HEADERS`, `…_INSECURE`, `…_CERTIFICATE`,
`…_CLIENT_CERTIFICATE`, `…_CLIENT_KEY`; `--otlp-endpoint` overrides the endpoint. As in the
SDK, `http://` means plaintext, `https://` TLS, and no scheme TLS unless `…_INSECURE=true`.

**Prometheus** (`PrometheusExporter`): a prometheus-client collector computes the same figures
at scrape time; names are the OpenTelemetry names with dots as underscores.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.util.re import parse_env_headers
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from plait.daemon.hangs import Hang

logger = logging.getLogger(__name__)

FORWARD_QUEUE_REQUESTS = 1024
FORWARD_TIMEOUT_SECONDS = 5.0
DAEMON_METRIC_INTERVAL_MS = 10_000


@dataclass(frozen=True, slots=True)
class DaemonPoint:
    """One figure the daemon publishes: OpenTelemetry name, value, attributes, kind."""

    name: str
    value: float
    attributes: dict[str, Any] = field(default_factory=dict)
    counter: bool = False  # monotonic since start (energy, errors, ingest counters)
    description: str = ""


PointSource = Callable[[], list[DaemonPoint]]


# --------------------------------------------------------------------------------------------
# OTLP upstream
# --------------------------------------------------------------------------------------------


def _env(signal: str, name: str) -> str:
    return os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_{name}") or os.environ.get(
        f"OTEL_EXPORTER_OTLP_{name}", ""
    )


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    """Where one signal goes and how to connect."""

    address: str  # host:port
    insecure: bool
    headers: dict[str, str]
    ca_cert: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None

    @classmethod
    def resolve(
        cls, signal: str, endpoint: str = "", insecure: bool | None = None
    ) -> UpstreamTarget | None:
        """From `endpoint` or the `OTEL_EXPORTER_OTLP_*` variables; None if no endpoint."""
        endpoint = endpoint or _env(signal, "ENDPOINT")
        if not endpoint:
            return None
        parsed = urlparse(endpoint if "://" in endpoint else f"//{endpoint}")
        if insecure is None:
            configured = _env(signal, "INSECURE")
            if parsed.scheme == "https":
                insecure = False
            elif configured:
                insecure = configured.strip().lower() == "true"
            else:
                insecure = parsed.scheme == "http"

        def read(name: str) -> bytes | None:
            path = _env(signal, name)
            return Path(path).read_bytes() if path else None

        return cls(
            address=parsed.netloc or endpoint,
            insecure=insecure,
            headers=parse_env_headers(_env(signal, "HEADERS"), liberal=True),
            ca_cert=read("CERTIFICATE"),
            client_cert=read("CLIENT_CERTIFICATE"),
            client_key=read("CLIENT_KEY"),
        )

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.insecure:
            return None
        return grpc.ssl_channel_credentials(self.ca_cert, self.client_key, self.client_cert)

    def channel(self) -> grpc.Channel:
        credentials = self.credentials()
        if credentials is None:
            return grpc.insecure_channel(self.address)
        return grpc.secure_channel(self.address, credentials)

    def exporter_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"endpoint": self.address, "insecure": self.insecure}
        if not self.insecure:
            kwargs["credentials"] = self.credentials()
        if self.headers:
            kwargs["headers"] = self.headers
        return kwargs

    def describe(self) -> str:
        return f"{'http' if self.insecure else 'https'}://{self.address}"


class OtlpUpstream:
    """Forwards received OTLP requests and publishes the daemon's own metrics and hang events."""

    def __init__(
        self,
        points: PointSource,
        *,
        endpoint: str = "",
        insecure: bool | None = None,
        hostname: str = "",
        metric_interval_ms: float = DAEMON_METRIC_INTERVAL_MS,
    ) -> None:
        traces = UpstreamTarget.resolve("TRACES", endpoint, insecure)
        metrics = UpstreamTarget.resolve("METRICS", endpoint, insecure)
        if traces is None or metrics is None:
            raise ValueError(
                "no OTLP endpoint: pass --otlp-endpoint or set OTEL_EXPORTER_OTLP_ENDPOINT"
            )
        self.traces, self.metrics = traces, metrics
        self._channels = {traces.channel()}
        self._trace_stub = trace_service_pb2_grpc.TraceServiceStub(next(iter(self._channels)))
        metrics_channel = metrics.channel() if metrics != traces else next(iter(self._channels))
        self._channels.add(metrics_channel)
        self._metrics_stub = metrics_service_pb2_grpc.MetricsServiceStub(metrics_channel)
        self._queue: queue.Queue[tuple[Callable[..., Any], Any, dict[str, str]]] = queue.Queue(
            FORWARD_QUEUE_REQUESTS
        )
        self.forwarded = 0
        self.dropped = 0
        self.failed = 0
        self._last_failure_log = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="plait-otlp-forward", daemon=True)

        resource = Resource.create({"service.name": "plait-daemon", "host.name": hostname})
        self.meter_provider = MeterProvider(
            resource=resource,
            metric_readers=[
                PeriodicExportingMetricReader(
                    OTLPMetricExporter(
                        timeout=FORWARD_TIMEOUT_SECONDS, **metrics.exporter_kwargs()
                    ),
                    export_interval_millis=metric_interval_ms,
                )
            ],
        )
        register_points(self.meter_provider, points)
        self.tracer_provider = TracerProvider(resource=resource)
        self.tracer_provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(timeout=FORWARD_TIMEOUT_SECONDS, **traces.exporter_kwargs()),
                schedule_delay_millis=200,
            )
        )
        self.tracer = self.tracer_provider.get_tracer("plait.daemon")

    def describe(self) -> str:
        return f"otlp {self.traces.describe()}"

    def start(self) -> None:
        self._thread.start()

    def _enqueue(self, call: Callable[..., Any], request: Any, headers: dict[str, str]) -> None:
        try:
            self._queue.put_nowait((call, request, headers))
        except queue.Full:
            self.dropped += 1

    def forward_spans(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        self._enqueue(self._trace_stub.Export, request, self.traces.headers)

    def forward_metrics(self, request: Any) -> None:
        self._enqueue(self._metrics_stub.Export, request, self.metrics.headers)

    def _drain(self) -> None:
        while not self._stop.is_set() or not self._queue.empty():
            try:
                call, request, headers = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                call(request, timeout=FORWARD_TIMEOUT_SECONDS, metadata=tuple(headers.items()))
                self.forwarded += 1
            except grpc.RpcError as exc:
                self.failed += 1
                if time.monotonic() - self._last_failure_log > 60:
                    self._last_failure_log = time.monotonic()
                    logger.warning("forwarding to %s failed: %s", self.traces.describe(), exc)

    def hang_event(self, hang: Hang) -> None:
        """A span covering the wait so far, with a `hang.detected` event naming the op."""
        attributes = hang_attributes(hang)
        span = self.tracer.start_span(
            "plait.collective.hang", start_time=hang.entered_ns, attributes=attributes
        )
        span.add_event("hang.detected", attributes=attributes)
        span.end()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=FORWARD_TIMEOUT_SECONDS + 1)
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown(timeout_millis=FORWARD_TIMEOUT_SECONDS * 1000)
        for channel in self._channels:
            channel.close()


def hang_attributes(hang: Hang) -> dict[str, Any]:
    return {
        "plait.job.id": hang.job_id,
        "plait.comm.group": hang.group,
        "plait.comm.group_ranks": list(hang.group_ranks),
        "plait.comm.op": hang.op,
        "plait.comm.seq": hang.seq,
        "plait.comm.purpose": hang.purpose,
        "plait.hang.entered_ranks": list(hang.entered_ranks),
        "plait.hang.missing_ranks": list(hang.missing_ranks),
        "plait.hang.unreported_ranks": list(hang.unreported_ranks),
        "plait.hang.waiting_seconds": hang.waiting_seconds,
    }


def register_points(provider: MeterProvider, points: PointSource) -> None:
    """Observable instruments, one per name `points()` yields (computed once per collection).

    The set of names is fixed at registration from a first call plus the known NVML names, so
    a figure that appears later (a job starting) is still exported.
    """
    meter = provider.get_meter("plait.daemon")
    cache: dict[str, Any] = {"at": 0.0, "points": []}

    def current() -> list[DaemonPoint]:
        now = time.monotonic()
        if now - cache["at"] > 0.5:
            cache["points"], cache["at"] = points(), now
        return cache["points"]

    def callback_for(name: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def observe(options: CallbackOptions) -> Iterator[Observation]:
            for point in current():
                if point.name == name:
                    yield Observation(point.value, point.attributes)

        return observe

    for name, counter in sorted(KNOWN_POINT_NAMES.items()):
        create = meter.create_observable_counter if counter else meter.create_observable_gauge
        create(name, callbacks=[callback_for(name)])


# Every name the daemon may publish and whether it is a monotonic counter.
KNOWN_POINT_NAMES: dict[str, bool] = {
    "hw.gpu.utilization": False,
    "hw.gpu.memory.utilization": False,
    "hw.gpu.memory.usage": False,
    "hw.gpu.memory.limit": False,
    "hw.power": False,
    "hw.energy": True,
    "hw.errors": True,
    "plait.gpu.sm_clock": False,
    "plait.gpu.throttled": False,
    "plait.gpu.throttle_reason": False,
    "plait.gpu.pcie.throughput": False,
    "plait.gpu.nvlink.throughput": False,
    "plait.rank.mfu": False,
    "plait.rank.step.duration": False,
    "plait.rank.tokens_per_second": False,
    "plait.rank.bottleneck.seconds": False,
    "plait.rank.straggler.score": False,
    "plait.job.mfu": False,
    "plait.job.tokens_per_second": False,
    "plait.job.step.duration": False,
    "plait.collective.hangs": False,
    "plait.daemon.spans.received": True,
    "plait.daemon.spans.dropped": True,
    "plait.daemon.metric_points.dropped": True,
    "plait.daemon.calls.rejected": True,
}


# --------------------------------------------------------------------------------------------
# Prometheus
# --------------------------------------------------------------------------------------------


def prometheus_name(name: str) -> str:
    return name.replace(".", "_").replace("-", "_")


class _PointsCollector(Collector):
    def __init__(self, points: PointSource) -> None:
        self.points = points

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        by_name: dict[str, list[DaemonPoint]] = {}
        for point in self.points():
            by_name.setdefault(point.name, []).append(point)
        for name, points in sorted(by_name.items()):
            labels = sorted({prometheus_name(k) for p in points for k in p.attributes})
            family_cls = CounterMetricFamily if points[0].counter else GaugeMetricFamily
            family = family_cls(prometheus_name(name), points[0].description or name, labels=labels)
            for point in points:
                values = {prometheus_name(k): v for k, v in point.attributes.items()}
                family.add_metric([str(values.get(label, "")) for label in labels], point.value)
            yield family


class PrometheusExporter:
    """`GET /metrics` on `address` ("host:port"; loopback by default)."""

    def __init__(
        self,
        points: PointSource,
        address: str,
        *,
        certfile: str | None = None,
        keyfile: str | None = None,
    ) -> None:
        from prometheus_client import start_http_server

        host, _, port = address.rpartition(":")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_PointsCollector(points))
        self.tls = certfile is not None
        self._server, self._thread = start_http_server(
            int(port),
            addr=host.strip("[]") or "127.0.0.1",
            registry=self.registry,
            certfile=certfile,
            keyfile=keyfile,
        )
        self.port = self._server.server_port
        self.address = f"{host or '127.0.0.1'}:{self.port}"

    def describe(self) -> str:
        return f"prometheus {'https' if self.tls else 'http'}://{self.address}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
