"""Rank-side OpenTelemetry: providers, OTLP/gRPC exporters to the node daemon, peak FLOP/s.

Each rank gets its own `TracerProvider` and `MeterProvider` (never the global ones, so several
engines in one process stay apart) with a `Resource` that says who the rank is: job, rank, host,
mesh coordinates, device and the device's peak FLOP/s. Step, phase and comm spans are built
and sent by the telemetry plugin's exporter thread (`plait.plugins.telemetry.exporter`) through
`send_spans`, and metrics go through a periodic reader, so the training loop only queues
records.

The daemon's MFU divides model FLOP/s by the peak this module puts in the resource, from
`plait.core.peak_flops`: the dense datasheet figure for the job's compute dtype on a known
accelerator (exact device name), the host's cached GEMM calibration on CPU.

A daemon that cannot be reached is not an error: `RankTelemetry.start` warns once and returns
`None`, and export failures later in the run are reported once, not on every batch.

A daemon bound beyond loopback requires TLS and a bearer token: ranks and the CLI read them
from `$PLAIT_DAEMON_TOKEN` and `$PLAIT_DAEMON_CA_CERT` (plus `$PLAIT_DAEMON_CLIENT_CERT` and
`$PLAIT_DAEMON_CLIENT_KEY` for mutual TLS); see `DaemonClientAuth`.

Besides the step metrics, a rank publishes a comm *heartbeat* every `HEARTBEAT_INTERVAL_MS`
through its own small metric reader: the collectives it has entered but not finished and the
last sequence number it issued per group. The daemon's hang detector compares them across
ranks (`plait.daemon.hangs`); the training thread only updates a dict per op.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from plait.core import telemetry_schema as schema
from plait.core.peak_flops import PeakFlops, peak_flops_for

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from plait.core.expert_load import ExpertLoad
    from plait.core.step import JobInfo, StepReport

DEFAULT_DAEMON_ADDRESS = "127.0.0.1:7461"
DAEMON_ENV = "PLAIT_DAEMON"
INSTRUMENTATION_NAME = "plait.telemetry"

# The wire names live in `plait.core.telemetry_schema`; these aliases keep the names this module
# has always exported.
ATTR_JOB_ID = schema.RESOURCE_JOB_ID
ATTR_RANK = schema.RESOURCE_RANK
ATTR_LOCAL_RANK = schema.RESOURCE_LOCAL_RANK
ATTR_WORLD_SIZE = schema.RESOURCE_WORLD_SIZE
ATTR_DEVICE = schema.RESOURCE_DEVICE
ATTR_DEVICE_NAME = schema.RESOURCE_DEVICE_NAME
ATTR_COMPUTE_DTYPE = schema.RESOURCE_COMPUTE_DTYPE
ATTR_PEAK_FLOPS = schema.RESOURCE_PEAK_FLOPS
ATTR_PEAK_FLOPS_SOURCE = schema.RESOURCE_PEAK_FLOPS_SOURCE
ATTR_MODEL_NAME = schema.RESOURCE_MODEL_NAME
ATTR_NUM_PARAMS = schema.RESOURCE_NUM_PARAMS
ATTR_FLOPS_PER_TOKEN = schema.RESOURCE_FLOPS_PER_TOKEN
ATTR_TOKENS_PER_STEP = schema.RESOURCE_TOKENS_PER_STEP
ATTR_MESH_COORD_PREFIX = schema.RESOURCE_MESH_COORD_PREFIX
ATTR_MESH_DEGREE_PREFIX = schema.RESOURCE_MESH_DEGREE_PREFIX

ATTR_STEP = schema.SPAN_STEP
ATTR_STEP_TOKENS = schema.SPAN_STEP_TOKENS
ATTR_STEP_MODEL_FLOPS = schema.SPAN_STEP_MODEL_FLOPS
ATTR_STEP_DATA_WAIT = schema.SPAN_STEP_DATA_WAIT
ATTR_STEP_LOSS = schema.SPAN_STEP_LOSS
ATTR_PHASE = schema.SPAN_PHASE
ATTR_COMM_OP = schema.SPAN_COMM_OP
ATTR_COMM_BYTES = schema.SPAN_COMM_BYTES
ATTR_COMM_DTYPE = schema.SPAN_COMM_DTYPE
ATTR_COMM_GROUP = schema.SPAN_COMM_GROUP
ATTR_COMM_GROUP_RANKS = schema.SPAN_COMM_GROUP_RANKS
ATTR_COMM_SEQ = schema.SPAN_COMM_SEQ
ATTR_COMM_PURPOSE = schema.SPAN_COMM_PURPOSE
ATTR_COMM_PEER = schema.SPAN_COMM_PEER
ATTR_COMM_ASYNC = schema.SPAN_COMM_ASYNC
STEP_SPAN_NAME = schema.STEP_SPAN_NAME

# Comm heartbeat gauges (see `plait.daemon.hangs`).
METRIC_COMM_HEARTBEAT = schema.METRIC_COMM_HEARTBEAT
METRIC_COMM_INFLIGHT = schema.METRIC_COMM_INFLIGHT
METRIC_COMM_ENTERED = schema.METRIC_COMM_ENTERED
HEARTBEAT_INTERVAL_MS = 1000
TRACE_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
HEARTBEAT_ENV = "PLAIT_HEARTBEAT_INTERVAL_MS"

# Client credentials for a daemon that requires TLS and a token.
TOKEN_ENV = "PLAIT_DAEMON_TOKEN"
CA_CERT_ENV = "PLAIT_DAEMON_CA_CERT"
CLIENT_CERT_ENV = "PLAIT_DAEMON_CLIENT_CERT"
CLIENT_KEY_ENV = "PLAIT_DAEMON_CLIENT_KEY"

# Export settings: short timeouts so a vanished daemon costs a background thread a couple of
# seconds, never the training loop.
EXPORT_TIMEOUT_SECONDS = 2.0
SPAN_BATCH_DELAY_MS = 500
SPAN_QUEUE_SIZE = 65536
SPAN_BATCH_SIZE = 4096
METRIC_INTERVAL_MS = 5000
CONNECT_TIMEOUT_SECONDS = 1.0

logger = logging.getLogger(__name__)

GroupId = tuple[str, tuple[int, ...]]  # (group name, global ranks)


class InflightComm(Protocol):
    """What the heartbeat reports of an op in flight (the telemetry plugin's `CommRecord`)."""

    op: str
    group_name: str
    group_ranks: tuple[int, ...]
    seq: int
    purpose: str
    start_ns: int


# --------------------------------------------------------------------------------------------
# exporters that fail quietly
# --------------------------------------------------------------------------------------------


class _WarnOnce:
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


class _DropEndpointLogs(logging.Filter):
    """Silences the OTLP exporter's per-batch error logs for our endpoint (we warn once)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__()
        self.endpoint = endpoint

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return self.endpoint not in args


class _QuietSpanExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, warn: _WarnOnce) -> None:
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


class _QuietMetricExporter(MetricExporter):
    def __init__(self, inner: MetricExporter, warn: _WarnOnce) -> None:
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


# --------------------------------------------------------------------------------------------
# the rank's providers
# --------------------------------------------------------------------------------------------


def resolve_daemon_address(configured: str = "") -> str:
    """The config's address, else `$PLAIT_DAEMON`, else the daemon's default bind address."""
    return configured or os.environ.get(DAEMON_ENV, "") or DEFAULT_DAEMON_ADDRESS


@dataclass(frozen=True, slots=True)
class DaemonClientAuth:
    """How a client (rank or CLI) talks to a daemon: TLS roots, client certificate, token."""

    token: str = ""
    ca_cert: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None

    @classmethod
    def from_env(cls) -> DaemonClientAuth:
        def read(variable: str) -> bytes | None:
            path = os.environ.get(variable, "")
            return Path(path).read_bytes() if path else None

        return cls(
            token=os.environ.get(TOKEN_ENV, ""),
            ca_cert=read(CA_CERT_ENV),
            client_cert=read(CLIENT_CERT_ENV),
            client_key=read(CLIENT_KEY_ENV),
        )

    @property
    def tls(self) -> bool:
        return self.ca_cert is not None

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_cert,
            private_key=self.client_key,
            certificate_chain=self.client_cert,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to `address` that sends the token with every call."""
        credentials = self.credentials()
        if credentials is None:
            channel = grpc.insecure_channel(address, options=list(options))
        else:
            channel = grpc.secure_channel(address, credentials, options=list(options))
        if self.token:
            channel = grpc.intercept_channel(channel, _TokenClientInterceptor(self.metadata()))
        return channel


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _with_token(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), *self._metadata])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)


def daemon_reachable(
    address: str,
    timeout: float = CONNECT_TIMEOUT_SECONDS,
    auth: DaemonClientAuth | None = None,
) -> bool:
    """True when a gRPC server accepts a connection at `address` within `timeout` seconds."""
    channel = (auth or DaemonClientAuth()).channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def peak_flops_for_job(info: JobInfo) -> PeakFlops:
    """The rank's peak for the job's compute dtype (`JobInfo.compute_dtype`: under autocast the
    precision policy's dtype, not the parameters')."""
    return peak_flops_for(info.device, info.device_name, info.compute_dtype)


def restart_attempt() -> int:
    """torchrun's restart count for this launcher (0 outside torchrun or before a restart)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return int(value) if value.isdigit() else 0


def resource_attributes(info: JobInfo, peak: PeakFlops) -> dict[str, Any]:
    """The OpenTelemetry resource of one rank (semantic-convention names where they exist)."""
    attributes: dict[str, Any] = {
        "service.name": "plait",
        "service.instance.id": f"{info.job_id}/{info.rank}",
        schema.RESOURCE_HOST_NAME: info.host,
        schema.RESOURCE_PROCESS_PID: os.getpid(),
        ATTR_JOB_ID: info.job_id,
        ATTR_RANK: info.rank,
        ATTR_LOCAL_RANK: info.local_rank,
        ATTR_WORLD_SIZE: info.world_size,
        # torchrun counts its restarts; a new attempt is a new world of the job for the daemon.
        schema.RESOURCE_RESTART_ATTEMPT: restart_attempt(),
        ATTR_DEVICE: info.device,
        ATTR_DEVICE_NAME: info.device_name,
        ATTR_COMPUTE_DTYPE: info.compute_dtype,
        ATTR_PEAK_FLOPS: float(peak.flops),
        ATTR_PEAK_FLOPS_SOURCE: peak.source,
        ATTR_MODEL_NAME: info.model_name,
        ATTR_NUM_PARAMS: int(info.num_params),
        ATTR_FLOPS_PER_TOKEN: float(info.flops_per_token),
        ATTR_TOKENS_PER_STEP: int(info.tokens_per_step),
    }
    for axis, coordinate in info.coordinates.items():
        attributes[ATTR_MESH_COORD_PREFIX + axis] = int(coordinate)
    for axis, degree in info.degrees.items():
        attributes[ATTR_MESH_DEGREE_PREFIX + axis] = int(degree)
    return attributes


class RankTelemetry:
    """One rank's tracer and meter, exporting over OTLP/gRPC to the daemon at `address`."""

    def __init__(
        self,
        info: JobInfo,
        address: str,
        peak: PeakFlops,
        auth: DaemonClientAuth | None = None,
    ) -> None:
        self.info, self.address, self.peak = info, address, peak
        self.auth = auth or DaemonClientAuth()
        exporter_auth: dict[str, Any] = {"insecure": not self.auth.tls}
        if self.auth.tls:
            exporter_auth["credentials"] = self.auth.credentials()
        if self.auth.token:
            exporter_auth["headers"] = dict(self.auth.metadata())
        self._exporter_auth = exporter_auth
        self._heartbeat_provider: MeterProvider | None = None
        self.resource = Resource.create(resource_attributes(info, peak))
        warn = _WarnOnce(address)
        self._log_filter = _DropEndpointLogs(address)
        logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").addFilter(
            self._log_filter
        )
        self.tracer_provider = TracerProvider(resource=self.resource)
        span_exporter = OTLPSpanExporter(
            endpoint=address, timeout=EXPORT_TIMEOUT_SECONDS, **exporter_auth
        )
        self.tracer_provider.add_span_processor(
            BatchSpanProcessor(
                _QuietSpanExporter(span_exporter, warn),
                max_queue_size=SPAN_QUEUE_SIZE,
                schedule_delay_millis=SPAN_BATCH_DELAY_MS,
                max_export_batch_size=SPAN_BATCH_SIZE,
                export_timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000,
            )
        )
        metric_exporter = OTLPMetricExporter(
            endpoint=address, timeout=EXPORT_TIMEOUT_SECONDS, **exporter_auth
        )
        self._warn = warn
        self.resource_attributes = resource_attributes(info, peak)
        # Step, phase and comm spans are built in protobuf by the telemetry plugin's exporter
        # thread and sent through this stub; the SDK tracer above serves ad-hoc spans.
        self._trace_channel = self.auth.channel(address)
        self._export_spans = self._trace_channel.unary_unary(
            TRACE_EXPORT_METHOD,
            request_serializer=None,  # requests arrive serialized
            response_deserializer=ExportTraceServiceResponse.FromString,
        )
        self.metric_reader = PeriodicExportingMetricReader(
            _QuietMetricExporter(metric_exporter, warn),
            export_interval_millis=float(
                os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", METRIC_INTERVAL_MS)
            ),
            export_timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000,
        )
        self.meter_provider = MeterProvider(
            resource=self.resource, metric_readers=[self.metric_reader]
        )
        from plait import __version__

        self.tracer: Tracer = self.tracer_provider.get_tracer(INSTRUMENTATION_NAME, __version__)
        meter = self.meter_provider.get_meter(INSTRUMENTATION_NAME, __version__)
        # Job-wide figures: every rank reports the same value for a step (aggregate with max).
        self.tokens = meter.create_counter(
            schema.METRIC_JOB_TOKENS,
            unit=schema.UNIT_TOKEN,
            description="tokens processed by the whole job",
        )
        self.model_flops = meter.create_counter(
            schema.METRIC_JOB_MODEL_FLOPS,
            unit=schema.UNIT_FLOP,
            description="training FLOPs of the whole job",
        )
        self.step_duration = meter.create_histogram(
            schema.METRIC_STEP_DURATION,
            unit=schema.UNIT_SECONDS,
            description="optimizer step wall time on this rank",
        )
        self.data_wait = meter.create_histogram(
            schema.METRIC_DATA_WAIT,
            unit=schema.UNIT_SECONDS,
            description="time this rank waited for its batch",
        )
        self.loss = meter.create_gauge(
            schema.METRIC_TRAIN_LOSS, description="last step's mean loss"
        )
        if info.device.startswith("cuda"):
            meter.create_observable_gauge(
                schema.METRIC_DEVICE_MEMORY_USED,
                callbacks=[self._observe_device_memory],
                unit=schema.UNIT_BYTES,
                description="bytes allocated by torch on this rank's device",
            )

    def _observe_device_memory(self, options: CallbackOptions) -> list[Observation]:
        import torch

        return [Observation(torch.cuda.memory_allocated(self.info.device))]

    def start_heartbeat(
        self, source: Callable[[], tuple[Sequence[InflightComm], Mapping[GroupId, int]]]
    ) -> None:
        """Publish `source()` (ops in flight, last seq per group) every heartbeat interval.

        A separate provider and reader, so the heartbeat's short interval does not make the
        step metrics export more often; `source` runs on the reader's thread.
        """
        if self._heartbeat_provider is not None:
            return
        from plait import __version__

        exporter = OTLPMetricExporter(
            endpoint=self.address, timeout=EXPORT_TIMEOUT_SECONDS, **self._exporter_auth
        )
        reader = PeriodicExportingMetricReader(
            _QuietMetricExporter(exporter, self._warn),
            export_interval_millis=float(os.environ.get(HEARTBEAT_ENV, HEARTBEAT_INTERVAL_MS)),
            export_timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000,
        )
        provider = MeterProvider(resource=self.resource, metric_readers=[reader])
        meter = provider.get_meter(INSTRUMENTATION_NAME + ".heartbeat", __version__)
        snapshot: dict[str, Any] = {}

        def observe_heartbeat(options: CallbackOptions) -> list[Observation]:
            # One snapshot per collection serves all three gauges (heartbeat runs first).
            snapshot["inflight"], snapshot["entered"] = source()
            return [Observation(time.time())]

        def observe_inflight(options: CallbackOptions) -> list[Observation]:
            return [
                Observation(
                    op.start_ns / 1e9,
                    {
                        ATTR_COMM_GROUP: op.group_name,
                        ATTR_COMM_GROUP_RANKS: list(op.group_ranks),
                        ATTR_COMM_OP: op.op,
                        ATTR_COMM_SEQ: op.seq,
                        ATTR_COMM_PURPOSE: op.purpose,
                    },
                )
                for op in snapshot.get("inflight", ())
            ]

        def observe_entered(options: CallbackOptions) -> list[Observation]:
            return [
                Observation(seq, {ATTR_COMM_GROUP: name, ATTR_COMM_GROUP_RANKS: list(ranks)})
                for (name, ranks), seq in snapshot.get("entered", {}).items()
            ]

        meter.create_observable_gauge(METRIC_COMM_HEARTBEAT, callbacks=[observe_heartbeat])
        meter.create_observable_gauge(METRIC_COMM_INFLIGHT, callbacks=[observe_inflight])
        meter.create_observable_gauge(METRIC_COMM_ENTERED, callbacks=[observe_entered])
        self._heartbeat_provider = provider

    @classmethod
    def start(cls, info: JobInfo, address: str) -> RankTelemetry | None:
        """Providers for this rank, or `None` (after one warning) if the daemon is unreachable."""
        auth = DaemonClientAuth.from_env()
        if not daemon_reachable(address, auth=auth):
            logger.warning(
                "plait telemetry: no daemon reachable at %s (start one with `plait daemon`, or "
                "set telemetry.daemon / $%s); training continues without telemetry",
                address,
                DAEMON_ENV,
            )
            return None
        return cls(info, address, peak_flops_for_job(info), auth)

    def send_spans(self, request: bytes) -> None:
        """Send one serialized OTLP trace request (exporter thread); failures warn once."""
        try:
            self._export_spans(request, timeout=EXPORT_TIMEOUT_SECONDS)
        except grpc.RpcError:
            self._warn("spans")

    def record_step(self, report: StepReport) -> None:
        """The step metrics (called off the training thread by the span exporter)."""
        self.tokens.add(report.tokens)
        self.model_flops.add(float(report.model_flops))
        self.step_duration.record(report.step_seconds)
        self.data_wait.record(report.data_wait_seconds)
        self.loss.set(report.loss)

    def record_expert_load(self, step: int, load: ExpertLoad) -> None:
        """One span per MoE layer with the step's tokens per expert and dropped tokens."""
        for layer in load.layers:
            attributes = {
                schema.SPAN_STEP: step,
                schema.SPAN_MOE_LAYER: layer.layer,
                schema.SPAN_MOE_TOKENS_PER_EXPERT: list(layer.tokens_per_expert),
                schema.SPAN_MOE_DROPPED: layer.dropped,
            }
            self.tracer.start_span(schema.EXPERT_LOAD_SPAN_NAME, attributes=attributes).end()

    def end_job(self, outcome: str = schema.JOB_OUTCOME_FINISHED, last_step: int = -1) -> None:
        """Tell the daemon this rank's run ended (sent with the next flush)."""
        attributes: dict[str, Any] = {schema.SPAN_JOB_OUTCOME: outcome}
        if last_step >= 0:
            attributes[schema.SPAN_STEP] = last_step
        self.tracer.start_span(schema.JOB_END_SPAN_NAME, attributes=attributes).end()

    def flush(self, timeout_seconds: float = EXPORT_TIMEOUT_SECONDS) -> None:
        """Send everything buffered now (the daemon sees a run's last steps before it exits)."""
        timeout_ms = int(timeout_seconds * 1000)
        self.tracer_provider.force_flush(timeout_ms)
        self.meter_provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        try:
            if self._heartbeat_provider is not None:
                self._heartbeat_provider.shutdown(timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000)
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown(timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000)
            self._trace_channel.close()
        finally:
            logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").removeFilter(
                self._log_filter
            )
