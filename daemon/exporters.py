"""Exporters: forward upstream over OTLP, and serve Prometheus text.

**OTLP upstream** (`OtlpUpstream`): every request the ranks export is forwarded as received,
less the items the decoder rejected (the daemon is a pass-through hop, like an OpenTelemetry
Collector's OTLP exporter), through `plait.daemon.forwarding.Forwarder`: a queue bounded in
requests and bytes, drained by one thread that retries with exponential backoff where the OTLP
specification allows; drops are counted per reason and shown by `plait status`. The daemon's
own figures (per-rank and per-job MFU, bottleneck classes, straggler scores, NVML `hw.*`
metrics, ingest counters) go through the OpenTelemetry SDK's OTLP metric exporter, and each
detected hang as a span with a `hang.detected` event through its span exporter. The endpoint
and its settings follow the OpenTelemetry exporter variables, `OTEL_EXPORTER_OTLP_ENDPOINT`
(or `…_TRACES_ENDPOINT` / `…_METRICS_ENDPOINT`), `…_HEADERS`, `…_INSECURE`, `…_CERTIFICATE`,
`…_CLIENT_CERTIFICATE`, `…_CLIENT_KEY`; `--otlp-endpoint` overrides the endpoint. As in the
SDK, `http://` means plaintext, `https://` TLS, and no scheme TLS unless `…_INSECURE=true`.

**Prometheus** (`PrometheusExporter`): a prometheus-client collector computes the same figures
at scrape time. Names follow the OpenTelemetry-to-Prometheus rules: dots become underscores, the
unit is appended as a word (`s` → `_seconds`, `By` → `_bytes`, a dimensionless gauge `1` →
`_ratio`, `W` → `_watts`, `J` → `_joules`, `Hz` → `_hertz`) unless the name already ends with
it, and counters end in `_total` (`prometheus_name`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import grpc
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.util.re import parse_env_headers
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from plait.daemon import telemetry_schema as schema
from plait.daemon.forwarding import Forwarder, ForwarderStats, RetryPolicy, outgoing
from plait.daemon.hangs import Hang

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider

logger = logging.getLogger(__name__)

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

    @property
    def unit(self) -> str:
        return KNOWN_POINTS.get(self.name, (self.counter, ""))[1]


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
        retry: RetryPolicy | None = None,
        queue_bytes: int | None = None,
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
        limits = {"max_bytes": queue_bytes} if queue_bytes is not None else {}
        self.forwarder = Forwarder(
            traces.describe(),
            policy=retry,
            send_timeout_seconds=FORWARD_TIMEOUT_SECONDS,
            **limits,
        )

        # The SDK is loaded only for an upstream: a daemon without one (and `plait status`,
        # which shares these modules) never imports it.
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

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
        self.forwarder.start()

    def stats(self) -> ForwarderStats:
        return self.forwarder.snapshot()

    def forward_spans(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        if len(request.resource_spans):
            self.forwarder.put(
                outgoing(self._trace_stub.Export, request, tuple(self.traces.headers.items()))
            )

    def forward_metrics(self, request: Any) -> None:
        if len(request.resource_metrics):
            self.forwarder.put(
                outgoing(self._metrics_stub.Export, request, tuple(self.metrics.headers.items()))
            )

    def hang_event(self, hang: Hang) -> None:
        """A span covering the wait so far, with a `hang.detected` event naming the op."""
        attributes = hang_attributes(hang)
        span = self.tracer.start_span(
            "plait.collective.hang", start_time=hang.entered_ns, attributes=attributes
        )
        span.add_event("hang.detected", attributes=attributes)
        span.end()

    def stop(self, flush_seconds: float = FORWARD_TIMEOUT_SECONDS) -> None:
        self.forwarder.stop(flush_seconds)
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown(timeout_millis=FORWARD_TIMEOUT_SECONDS * 1000)
        for channel in self._channels:
            channel.close()


def hang_attributes(hang: Hang) -> dict[str, Any]:
    return {
        schema.RESOURCE_JOB_ID: hang.job_id,
        schema.SPAN_COMM_GROUP: hang.group,
        schema.SPAN_COMM_GROUP_RANKS: list(hang.group_ranks),
        schema.SPAN_COMM_OP: hang.op,
        schema.SPAN_COMM_SEQ: hang.seq,
        schema.SPAN_COMM_PURPOSE: hang.purpose,
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

    for name, (counter, unit) in sorted(KNOWN_POINTS.items()):
        create = meter.create_observable_counter if counter else meter.create_observable_gauge
        create(name, callbacks=[callback_for(name)], unit=unit)


# Every name the daemon may publish: (monotonic counter?, UCUM unit).
KNOWN_POINTS: dict[str, tuple[bool, str]] = {
    "hw.gpu.utilization": (False, "1"),
    "hw.gpu.memory.utilization": (False, "1"),
    "hw.gpu.memory.usage": (False, "By"),
    "hw.gpu.memory.limit": (False, "By"),
    "hw.power": (False, "W"),
    "hw.energy": (True, "J"),
    "hw.errors": (True, "{error}"),
    "plait.gpu.sm_clock": (False, "Hz"),
    "plait.gpu.throttled": (False, ""),  # 0 or 1: a flag, not a ratio
    "plait.gpu.throttle_reason": (False, "{reason}"),
    "plait.gpu.pcie.throughput": (False, "By/s"),
    "plait.gpu.nvlink.throughput": (False, "By/s"),
    # The host collector's figures (OpenTelemetry's system and process semantic conventions).
    "system.cpu.utilization": (False, "1"),
    "system.memory.usage": (False, "By"),
    "system.memory.limit": (False, "By"),
    "system.network.io": (True, "By"),
    "process.cpu.utilization": (False, "1"),
    "process.memory.usage": (False, "By"),
    "plait.rank.mfu": (False, "1"),
    "plait.rank.step.duration": (False, "s"),
    "plait.rank.tokens_per_second": (False, "{token}/s"),
    "plait.rank.bottleneck.seconds": (False, "s"),
    "plait.rank.straggler.score": (False, "1"),
    # Bytes a rank sent since the daemon first heard it, by link class (label plait.comm.link).
    "plait.rank.comm.bytes": (True, "By"),
    "plait.job.mfu": (False, "1"),
    "plait.job.tokens_per_second": (False, "{token}/s"),
    # The daemon's share of the job's achieved and peak FLOP/s: summed over a job's daemons,
    # their ratio is the job's MFU (what `plait top` prints across hosts).
    "plait.job.flops.achieved": (False, "{flop}/s"),
    "plait.job.flops.peak": (False, "{flop}/s"),
    "plait.job.step.duration": (False, "s"),
    "plait.job.ranks.reporting": (False, "{rank}"),
    "plait.job.ranks.stale": (False, "{rank}"),
    "plait.job.world.size": (False, "{rank}"),
    "plait.job.restarts": (False, "{restart}"),
    "plait.job.comm.bytes": (True, "By"),
    "plait.moe.expert.imbalance": (False, "1"),
    "plait.moe.tokens.dropped": (False, "{token}"),
    "plait.collective.hangs": (False, "{hang}"),
    "plait.daemon.spans.received": (True, "{span}"),
    "plait.daemon.spans.dropped": (True, "{span}"),
    "plait.daemon.spans.rejected": (True, "{span}"),
    "plait.daemon.metric_points.dropped": (True, "{point}"),
    "plait.daemon.metric_points.rejected": (True, "{point}"),
    "plait.daemon.forward.dropped": (True, "{request}"),
    "plait.daemon.forward.queued": (False, "By"),
    "plait.daemon.calls.rejected": (True, "{call}"),
}
KNOWN_POINT_NAMES: dict[str, bool] = {name: counter for name, (counter, _) in KNOWN_POINTS.items()}


# --------------------------------------------------------------------------------------------
# Prometheus
# --------------------------------------------------------------------------------------------

# UCUM unit -> Prometheus unit word (OpenTelemetry's Prometheus compatibility specification).
PROMETHEUS_UNITS = {
    "s": "seconds",
    "ms": "milliseconds",
    "By": "bytes",
    "W": "watts",
    "J": "joules",
    "Hz": "hertz",
    "Cel": "celsius",
}


PROMETHEUS_PER_UNITS = {"s": "second", "m": "minute", "h": "hour", "d": "day"}


def _prometheus_unit(unit: str, counter: bool) -> str:
    """The unit words for a name: "s" -> "seconds", "By/s" -> "bytes_per_second"."""
    if unit == "1":
        return "" if counter else "ratio"
    numerator, _, denominator = unit.partition("/")
    words = []
    # Annotations in braces ("{token}") are counts of things, not units.
    if numerator and not numerator.startswith("{"):
        words.append(PROMETHEUS_UNITS.get(numerator, numerator))
    if denominator:
        words.append(f"per_{PROMETHEUS_PER_UNITS.get(denominator, denominator)}")
    return "_".join(words)


def prometheus_name(name: str, unit: str = "", counter: bool = False) -> str:
    """`plait.rank.step.duration` (s) -> `plait_rank_step_duration_seconds`, and so on.

    Counters get no `_total` here: prometheus-client adds it to counter samples itself.
    """
    base = name.replace(".", "_").replace("-", "_")
    suffix = _prometheus_unit(unit, counter)
    if suffix and not base.endswith(suffix):
        base = f"{base}_{suffix}"
    return base


def _label(key: str) -> str:
    return key.replace(".", "_").replace("-", "_")


class _PointsCollector(Collector):
    def __init__(self, points: PointSource) -> None:
        self.points = points

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        by_name: dict[str, list[DaemonPoint]] = {}
        for point in self.points():
            by_name.setdefault(point.name, []).append(point)
        for name, points in sorted(by_name.items()):
            labels = sorted({_label(k) for p in points for k in p.attributes})
            counter = points[0].counter
            family_cls = CounterMetricFamily if counter else GaugeMetricFamily
            family = family_cls(
                prometheus_name(name, points[0].unit, counter),
                points[0].description or name,
                labels=labels,
            )
            for point in points:
                values = {_label(k): v for k, v in point.attributes.items()}
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
