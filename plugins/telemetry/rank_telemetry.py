"""One rank's telemetry connection to its node daemon: the span exporter, step metrics and the
comm heartbeat, over OTLP/gRPC.

The control channel (`plait.plugins.telemetry.control_client`) rides on the same connection:
it polls the daemon from the exporter thread, and `step_started` / `step_finished` let a
profile or memory capture begin and end on step boundaries.

Each rank gets its own `MeterProvider` (never the global one, so several engines in one process
stay apart) with a resource that says who the rank is (`plait.daemon.telemetry_resource`). Every
span — step, phase, comm, expert load, end of run — is built and sent by the plugin's exporter
thread (`plait.plugins.telemetry.exporter`) through `send_spans`; metrics go through a periodic
reader. The training thread only queues records.

A daemon that cannot be reached is not an error: `RankTelemetry.start` warns once and returns
`None`, and export failures later in the run are reported once, not on every batch.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from plait.daemon import telemetry_schema as schema
from plait.daemon.address import DAEMON_ENV
from plait.daemon.client_auth import DaemonClientAuth, daemon_reachable
from plait.daemon.telemetry_resource import peak_flops_for_job, resource_attributes
from plait.plugins.telemetry.control_client import ControlClient
from plait.plugins.telemetry.exporter import SpanExporter
from plait.plugins.telemetry.heartbeat import HeartbeatSource, InflightComm, start_heartbeat
from plait.plugins.telemetry.quiet_export import (
    OTLP_EXPORTER_LOGGER,
    DropEndpointLogs,
    QuietMetricExporter,
    QuietSpanExporter,
    WarnOnce,
)
from plait.plugins.telemetry.step_metrics import StepMetrics

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

    from plait.core.step import JobInfo, StepReport
    from plait.daemon.peak_flops import PeakFlops

INSTRUMENTATION_NAME = "plait.telemetry"
TRACE_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

# Export settings: short timeouts so a vanished daemon costs a background thread a couple of
# seconds, never the training loop.
EXPORT_TIMEOUT_SECONDS = 2.0
METRIC_INTERVAL_MS = 5000
# At shutdown the last steps and the end-of-run span go out together: room for a few sends on
# a loaded machine (a vanished daemon fails each send within EXPORT_TIMEOUT_SECONDS).
SHUTDOWN_FLUSH_SECONDS = 3 * EXPORT_TIMEOUT_SECONDS

logger = logging.getLogger("plait.telemetry")


def _version() -> str:
    from plait.core.version import __version__

    return __version__


class RankTelemetry:
    """One rank's span exporter, meter and heartbeat, exporting to the daemon at `address`."""

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
        self.resource_attributes = resource_attributes(info, peak)
        self.resource = Resource.create(self.resource_attributes)
        self._warn = WarnOnce(address)
        self._log_filter = DropEndpointLogs(address)
        logging.getLogger(OTLP_EXPORTER_LOGGER).addFilter(self._log_filter)
        self._heartbeat_provider: MeterProvider | None = None
        self._tracer_provider: TracerProvider | None = None
        # Spans are written as OTLP bytes by the exporter thread and sent through this stub.
        self._trace_channel = self.auth.channel(address)
        self._export_spans = self._trace_channel.unary_unary(
            TRACE_EXPORT_METHOD,
            request_serializer=None,  # requests arrive serialized
            response_deserializer=ExportTraceServiceResponse.FromString,
        )
        self.metric_reader = PeriodicExportingMetricReader(
            QuietMetricExporter(self._metric_exporter(), self._warn),
            export_interval_millis=float(
                os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", METRIC_INTERVAL_MS)
            ),
            export_timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000,
        )
        self.meter_provider = MeterProvider(
            resource=self.resource, metric_readers=[self.metric_reader]
        )
        meter = self.meter_provider.get_meter(INSTRUMENTATION_NAME, _version())
        self.metrics = StepMetrics(meter, info.device)
        self._heartbeat_source: HeartbeatSource | None = None
        self.spans = SpanExporter(
            send=self.send_spans,
            resource=self.resource_attributes,
            scope=(INSTRUMENTATION_NAME, _version()),
            on_step=self.record_step,
            device=info.device,
        )
        # The control channel polls from the exporter's thread, over the spans' channel.
        self.control = ControlClient(
            channel=self._trace_channel,
            info=info,
            flush_spans=self.spans.flush,
            inflight=self._inflight,
        )
        self.spans.on_tick = self.control.tick

    @classmethod
    def start(cls, info: JobInfo, address: str) -> RankTelemetry | None:
        """This rank's telemetry, or `None` (after one warning) if the daemon is unreachable."""
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

    def _metric_exporter(self) -> OTLPMetricExporter:
        return OTLPMetricExporter(
            endpoint=self.address, timeout=EXPORT_TIMEOUT_SECONDS, **self._exporter_auth
        )

    def start_heartbeat(self, source: HeartbeatSource) -> None:
        """Publish `source()` (ops in flight, last seq per group) every heartbeat interval."""
        if self._heartbeat_provider is not None:
            return
        self._heartbeat_source = source
        self._heartbeat_provider = start_heartbeat(
            self.resource,
            QuietMetricExporter(self._metric_exporter(), self._warn),
            source,
            scope=(INSTRUMENTATION_NAME + ".heartbeat", _version()),
            export_timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000,
        )

    def _inflight(self) -> list[InflightComm]:
        """Collectives entered and not finished (what `plait stacks` names beside the frames)."""
        source = self._heartbeat_source
        return list(source()[0]) if source is not None else []

    def step_started(self, step: int) -> None:
        """The training thread starts `step` (a profile or memory capture may start with it).

        The telemetry plugin calls this and `step_finished` from its step hooks; a loop the
        engine does not drive calls them itself around each optimizer step."""
        self.control.step_started(step)

    def step_finished(self, step: int) -> None:
        """The training thread finished `step`, after queueing its report."""
        self.control.step_finished(step)

    @property
    def tracer(self) -> Tracer:
        """An OpenTelemetry SDK tracer for ad-hoc spans, built on first use.

        plait's own spans never go through it (they are queued to `spans`); it is here for code
        that wants to add a span of its own to the rank's stream, off the training thread.
        """
        if self._tracer_provider is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider = TracerProvider(resource=self.resource)
            exporter = OTLPSpanExporter(
                endpoint=self.address, timeout=EXPORT_TIMEOUT_SECONDS, **self._exporter_auth
            )
            provider.add_span_processor(
                BatchSpanProcessor(
                    QuietSpanExporter(exporter, self._warn),
                    export_timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000,
                )
            )
            self._tracer_provider = provider
        return self._tracer_provider.get_tracer(INSTRUMENTATION_NAME, _version())

    def send_spans(self, request: bytes) -> None:
        """Send one serialized OTLP trace request (exporter thread); failures warn once."""
        try:
            self._export_spans(request, timeout=EXPORT_TIMEOUT_SECONDS)
        except grpc.RpcError:
            self._warn("spans")

    def record_step(self, report: StepReport) -> None:
        """The step metrics (called off the training thread by the span exporter)."""
        self.metrics.record(report)

    def end_job(self, outcome: str = schema.JOB_OUTCOME_FINISHED, last_step: int = -1) -> None:
        """Queue the end-of-run span (sent after everything queued before it)."""
        if outcome not in schema.JOB_OUTCOMES:
            raise ValueError(
                f"end_job: outcome must be one of {schema.JOB_OUTCOMES}, got {outcome!r}"
            )
        self.spans.put_job_end(outcome, last_step)

    def flush(self, timeout_seconds: float = EXPORT_TIMEOUT_SECONDS) -> None:
        """Send everything queued now (the daemon sees a run's last steps before it exits)."""
        self.spans.flush(timeout_seconds)
        timeout_ms = int(timeout_seconds * 1000)
        if self._tracer_provider is not None:
            self._tracer_provider.force_flush(timeout_ms)
        self.meter_provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Send what is queued and stop every exporter."""
        try:
            # A capture in progress is delivered first, then the daemon hears the rank leave.
            self.spans.on_tick = None
            self.control.close()
            self.spans.shutdown(SHUTDOWN_FLUSH_SECONDS)
            if self._heartbeat_provider is not None:
                self._heartbeat_provider.shutdown(timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000)
            if self._tracer_provider is not None:
                self._tracer_provider.shutdown()
            self.meter_provider.shutdown(timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000)
            self._trace_channel.close()
        finally:
            logging.getLogger(OTLP_EXPORTER_LOGGER).removeFilter(self._log_filter)
