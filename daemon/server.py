"""The per-node daemon: one gRPC server with the OTLP receivers, `plait.v1`, health, reflection.

Bound to loopback by default; any other address needs TLS and a token unless `insecure`
(`plait.daemon.security`). Around the server: the host and NVML collectors, the hang monitor
(logs each new hang and sends it upstream as an OpenTelemetry event), and the optional OTLP
upstream and Prometheus exporters. `DaemonServer.stop` shuts down the way load balancers and
orchestrators expect: the health service reports NOT_SERVING first, then the server stops
accepting calls and gives in-flight ones `grace` seconds, then the collectors stop.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from plait.daemon.analysis import StalePolicy
from plait.daemon.config import MAX_MESSAGE_BYTES, DaemonConfig
from plait.daemon.control import ControlRegistry
from plait.daemon.control_service import ControlService
from plait.daemon.exporters import OtlpUpstream, PrometheusExporter
from plait.daemon.forwarding import RetryPolicy
from plait.daemon.hangs import Hang
from plait.daemon.host import HostCollector
from plait.daemon.ingest_pool import IngestPool
from plait.daemon.interpreter import serving_interpreter
from plait.daemon.job_directory import JobDirectory
from plait.daemon.job_questions import JobQuestions, PeerChannels
from plait.daemon.nvml import NvmlCollector
from plait.daemon.otlp import IngestLimiter, add_receivers
from plait.daemon.security import OVERSIZE_HEADROOM, CallCounters, CallGuard, SecurityConfig
from plait.daemon.service import DaemonExtras, DaemonService, daemon_points
from plait.daemon.store import TelemetryStore
from plait.proto.plait.v1 import control_pb2, control_pb2_grpc, daemon_pb2, daemon_pb2_grpc

if TYPE_CHECKING:
    from plait.daemon.lighthouse import HostedLighthouse, LighthouseSettings
    from plait.daemon.web.page import WebPage

logger = logging.getLogger(__name__)

__all__ = ["MAX_MESSAGE_BYTES", "DaemonConfig", "DaemonServer", "serve"]
MAX_RESPONSE_BYTES = 256 * 1024 * 1024  # a whole-window trace capture can be large
HANG_CHECK_SECONDS = 1.0
DAEMON_SERVICE = daemon_pb2.DESCRIPTOR.services_by_name["Daemon"].full_name
SERVICE_NAMES = (
    DAEMON_SERVICE,
    control_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
    trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name,
    metrics_service_pb2.DESCRIPTOR.services_by_name["MetricsService"].full_name,
)


class DaemonServer:
    """A running (after `start`) daemon; `port` is the bound port (useful with port 0)."""

    def __init__(
        self,
        bind: str | None = None,
        *,
        config: DaemonConfig | None = None,
        nvml: NvmlCollector | None = None,
        otlp_retry: RetryPolicy | None = None,
        **settings: object,
    ) -> None:
        """A daemon as `config` says (default `DaemonConfig()`), with `bind` and any
        `DaemonConfig` field given as a keyword (`window_steps=64`) replacing the config's.

        `nvml` replaces the GPU collector and `otlp_retry` the upstream retry policy (tests).
        Raises `SecurityError` for a non-loopback bind without TLS and a token (unless
        `security.insecure`), `TypeError` for a keyword that is no `DaemonConfig` field.
        """
        config = replace(config or DaemonConfig(), **settings)  # type: ignore[arg-type]
        if bind is not None:
            config = replace(config, bind=bind)
        self.config = config
        self.bind = config.bind
        self.security = config.security or SecurityConfig()
        for address in (config.bind, config.prometheus, config.web):
            if address is not None:
                self.security.check_bind(address)
        self.store = TelemetryStore(
            window_steps=config.window_steps, window_spans=config.window_spans
        )
        self.host = HostCollector(self.store.local_pids, interval=config.host_interval)
        self.nvml = nvml if nvml is not None else NvmlCollector(interval=config.gpu_interval)
        self.stopping = threading.Event()
        self.counters = CallCounters()
        self._bind_grpc(config)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.extras = self._extras(config)
        self.service = DaemonService(
            self.store,
            self.host,
            bind_address=self.address,
            stopping=self.stopping,
            extras=self.extras,
        )
        daemon_pb2_grpc.add_DaemonServicer_to_server(self.service, self.server)
        self.upstream = self._upstream(config, otlp_retry)
        self.ingest_pool = self._ingest(config)
        self.prometheus_address = config.prometheus
        self.prometheus: PrometheusExporter | None = None  # bound at start
        self.reported_hangs: dict[tuple[str, int, str, tuple[int, ...], int], Hang] = {}
        self._hang_thread = threading.Thread(
            target=self._watch_hangs, name="plait-hang-monitor", daemon=True
        )
        self._control_channel(config)
        self._job_questions()
        # Bound here, so a taken port fails the daemon's start as the gRPC bind does.
        self.web = self._web_page(config.web) if config.web is not None else None
        self.lighthouse = self._lighthouse(config.lighthouse)
        if self.lighthouse is not None:
            self.extras.lighthouse_address = self.lighthouse.address
        if config.reflection_enabled:
            reflection.enable_server_reflection(
                (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
            )

    # -- the daemon's parts, each built once by __init__ -----------------------------------------

    def _bind_grpc(self, config: DaemonConfig) -> None:
        """The gRPC server behind the call guard, bound (`port`, `address`)."""
        max_message_bytes, max_workers = config.max_message_bytes, config.max_workers
        # Long-lived calls hold a worker thread each; keep a quarter for receivers and queries.
        streams = (
            config.max_streams if config.max_streams is not None else max(1, max_workers * 3 // 4)
        )
        self.guard = CallGuard(
            self.security.token,
            max_long_lived=streams,
            counters=self.counters,
            max_request_bytes=max_message_bytes,
        )
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="plait-daemon"),
            interceptors=[self.guard],
            options=[
                # The guard refuses requests over max_message_bytes with a status exporters do
                # not retry; gRPC's own limit (RESOURCE_EXHAUSTED) only applies beyond this.
                ("grpc.max_receive_message_length", max_message_bytes * OVERSIZE_HEADROOM),
                ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        credentials = self.security.server_credentials()
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(config.bind)
            else:
                self.port = self.server.add_secure_port(config.bind, credentials)
        except RuntimeError as exc:  # grpc reports a failed bind this way
            raise OSError(f"the daemon could not bind {config.bind!r} (address in use?)") from exc
        host_part = config.bind.rsplit(":", 1)[0]
        self.address = f"{host_part}:{self.port}"

    def _extras(self, config: DaemonConfig) -> DaemonExtras:
        return DaemonExtras(
            nvml=self.nvml,
            counters=self.counters,
            ingest_capacity=config.ingest_capacity,
            hang_timeout_seconds=config.hang_timeout,
            straggler_threshold=config.straggler_threshold,
            stale_policy=StalePolicy(
                floor_seconds=config.stale_floor,
                step_multiple=config.stale_step_multiple,
                ceiling_seconds=config.stale_ceiling,
            ),
        )

    def _upstream(self, config: DaemonConfig, retry: RetryPolicy | None) -> OtlpUpstream | None:
        """Forwarding upstream over OTLP, when the config names an endpoint."""
        if config.otlp_endpoint is None:
            return None
        upstream = OtlpUpstream(
            lambda: daemon_points(self.service),
            endpoint=config.otlp_endpoint,
            insecure=config.otlp_insecure,
            hostname=self.host.hostname,
            retry=retry,
            queue_bytes=config.otlp_queue_bytes,
        )
        self.extras.exporters.append(upstream.describe())
        self.extras.forwarder_stats = upstream.stats
        self.extras.forwarder_endpoint = upstream.traces.describe()
        return upstream

    def _ingest(self, config: DaemonConfig) -> IngestPool | None:
        """The OTLP receivers, and the worker processes decoding large requests if asked for
        (started before the gRPC server: workers are spawned while no call is in flight)."""
        pool = (
            IngestPool(config.ingest_workers, offload_bytes=config.ingest_offload_bytes)
            if config.ingest_workers
            else None
        )
        if pool is not None:
            self.extras.ingest_stats = pool.stats
        upstream = self.upstream
        add_receivers(
            self.server,
            self.store,
            limiter=IngestLimiter(config.ingest_capacity),
            pool=pool,
            counters=self.counters,
            forward_spans=upstream.forward_spans if upstream else None,
            forward_metrics=upstream.forward_metrics if upstream else None,
        )
        return pool

    def _control_channel(self, config: DaemonConfig) -> None:
        """The control channel: ranks poll it (and send the job's node list with it),
        operators profile, dump stacks and memory through it."""
        self.control = ControlRegistry(config.control)
        # Where each job's other daemons are: the node lists the ranks send with their polls.
        self.directory = JobDirectory()
        self.control_service = ControlService(
            self.control, self.store, stopping=self.stopping, directory=self.directory
        )
        self.extras.control_stats = self._control_stats
        control_pb2_grpc.add_ControlServicer_to_server(self.control_service, self.server)

    def _job_questions(self) -> None:
        """Answering for a whole job: the other daemons asked over channels kept open."""
        self.peers = PeerChannels(self.security.peer_auth())
        self.extras.job_questions = JobQuestions(
            directory=self.directory,
            hostname=self.host.hostname,
            handlers=self._job_question_handlers(),
            holds_job=self._holds_job,
            channels=self.peers,
        )

    def _job_question_handlers(self) -> dict[str, Callable[[Any, Any], Message]]:
        """The methods a peer daemon may ask for a job (`plait.daemon.job_questions`)."""
        service, control = self.service, self.control_service
        return {
            "Daemon/Status": service.Status,
            "Daemon/ListRanks": service.ListRanks,
            "Daemon/GetMetrics": service.GetMetrics,
            "Daemon/GetBottleneck": service.GetBottleneck,
            "Control/ListEndpoints": control.ListEndpoints,
            "Control/Clock": control.Clock,
            "Control/Stacks": control.Stacks,
            "Control/Memory": control.Memory,
        }

    def _holds_job(self, job_id: str) -> bool:
        """Ranks of `job_id` reported here: spans or metrics, a poll, or the job's node list."""
        return (
            job_id in self.store.job_ids()
            or self.directory.reports(job_id) != []
            or self.control.endpoints(job_id, now_ns=time.time_ns()) != []
        )

    def _web_page(self, bind: str) -> WebPage:
        """The live page (`plait.daemon.web`): another translation of the same services."""
        from plait.daemon.web.page import WebPage
        from plait.daemon.web.page_data import PageSource

        source = PageSource(self.service, self.address, self.config.straggler_threshold)
        return WebPage(
            bind,
            source=source,
            control=self.control_service,
            security=self.security,
            interval=self.config.web_interval,
        )

    @staticmethod
    def _lighthouse(settings: LighthouseSettings | None) -> HostedLighthouse | None:
        """torchft's lighthouse for fault-tolerant jobs, bound now like the gRPC port."""
        if settings is None:
            return None
        from plait.daemon.lighthouse import HostedLighthouse

        return HostedLighthouse(settings)

    def _control_stats(self) -> dict[str, int]:
        endpoints = self.control.endpoints(now_ns=time.time_ns())
        return {
            "control_endpoints": sum(e.polling for e in endpoints),
            "control_refused": self.control.refused,
            "control_rejected": self.control.rejected_chunks + self.control_service.bad_deliveries,
        }

    def start(self) -> DaemonServer:
        if self.prometheus_address is not None:
            tls = self.security
            self.prometheus = PrometheusExporter(
                lambda: daemon_points(self.service),
                self.prometheus_address,
                certfile=str(tls.tls_cert) if tls.tls_cert else None,
                keyfile=str(tls.tls_key) if tls.tls_key else None,
            )
            self.extras.exporters.append(self.prometheus.describe())
            self.extras.prometheus_address = self.prometheus.address  # the port bound
        if self.web is not None:
            self.extras.exporters.append(f"web page {self.web.url}")
        if self.lighthouse is not None:
            self.extras.exporters.append(f"lighthouse {self.lighthouse.address}")
        if self.upstream is not None:
            self.upstream.start()
        self.server.start()
        self.host.start()
        self.nvml.start()
        self._hang_thread.start()
        if self.web is not None:
            self.web.start()
        for name in ("", *SERVICE_NAMES):  # "" is the whole server
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("plait daemon listening on %s", self.address)
        return self

    def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING first, then stop with `grace` seconds for in-flight calls, then flush."""
        self.health.enter_graceful_shutdown()
        self.stopping.set()  # ends StreamMetrics and CaptureTrace waits promptly
        if self.web is not None:
            self.web.stop()  # its open event streams end before the services do
        self.server.stop(grace).wait()
        if self.ingest_pool is not None:
            self.ingest_pool.close()
        self.host.stop()
        self.nvml.stop()
        if self._hang_thread.is_alive():
            self._hang_thread.join(timeout=HANG_CHECK_SECONDS + 1)
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.upstream is not None:
            self.upstream.stop(flush_seconds=max(grace, 1.0))
        if self.lighthouse is not None:
            self.lighthouse.stop()
        self.peers.close()

    def _watch_hangs(self) -> None:
        """Report each new hang once (log + OpenTelemetry event); forget it when it clears."""
        while not self.stopping.wait(HANG_CHECK_SECONDS):
            current = {hang.key: hang for hang in self.service.hangs()}
            for key, hang in current.items():
                if key not in self.reported_hangs:
                    logger.warning("collective hang: %s", hang.describe())
                    if self.upstream is not None:
                        self.upstream.hang_event(hang)
            self.reported_hangs = current

    def wait(self) -> None:
        self.server.wait_for_termination()

    def __enter__(self) -> DaemonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=1.0)


def serve(server: DaemonServer, *, grace: float = 5.0) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully. The process is the daemon's:
    its interpreter is set for serving (`plait.daemon.interpreter`)."""
    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with serving_interpreter():
            server.start()
            done.wait()
    finally:
        server.stop(grace)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
