"""The per-node daemon: one gRPC server with the OTLP receivers, `plait.v1`, health, reflection.

Bound to loopback by default. `DaemonServer.stop` shuts down the way load balancers and
orchestrators expect: the health service reports NOT_SERVING first, then the server stops
accepting calls and gives in-flight ones `grace` seconds, then the collectors stop.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from plait.core.telemetry import DEFAULT_DAEMON_ADDRESS
from plait.daemon.host import HostCollector
from plait.daemon.otlp import add_receivers
from plait.daemon.service import DaemonService
from plait.daemon.store import DEFAULT_WINDOW_SPANS, DEFAULT_WINDOW_STEPS, TelemetryStore
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DAEMON_SERVICE = daemon_pb2.DESCRIPTOR.services_by_name["Daemon"].full_name
SERVICE_NAMES = (
    DAEMON_SERVICE,
    trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name,
    metrics_service_pb2.DESCRIPTOR.services_by_name["MetricsService"].full_name,
)


class DaemonServer:
    """A running (after `start`) daemon; `port` is the bound port (useful with port 0)."""

    def __init__(
        self,
        bind: str = DEFAULT_DAEMON_ADDRESS,
        *,
        window_steps: int = DEFAULT_WINDOW_STEPS,
        window_spans: int = DEFAULT_WINDOW_SPANS,
        reflection_enabled: bool = True,
        host_interval: float = 1.0,
        max_workers: int = 64,
    ) -> None:
        self.bind = bind
        self.store = TelemetryStore(window_steps=window_steps, window_spans=window_spans)
        self.host = HostCollector(self.store.local_pids, interval=host_interval)
        self.stopping = threading.Event()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="plait-daemon"),
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        try:
            self.port = self.server.add_insecure_port(bind)
        except RuntimeError as exc:  # grpc reports a failed bind this way
            raise OSError(f"the daemon could not bind {bind!r} (address in use?)") from exc
        host_part = bind.rsplit(":", 1)[0]
        self.address = f"{host_part}:{self.port}"
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        add_receivers(self.server, self.store)
        self.service = DaemonService(
            self.store, self.host, bind_address=self.address, stopping=self.stopping
        )
        daemon_pb2_grpc.add_DaemonServicer_to_server(self.service, self.server)
        if reflection_enabled:
            reflection.enable_server_reflection(
                (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
            )

    def start(self) -> DaemonServer:
        self.server.start()
        self.host.start()
        for name in ("", *SERVICE_NAMES):  # "" is the whole server
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("plait daemon listening on %s", self.address)
        return self

    def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING first, then stop with `grace` seconds for in-flight calls, then flush."""
        self.health.enter_graceful_shutdown()
        self.stopping.set()  # ends StreamMetrics and CaptureTrace waits promptly
        self.server.stop(grace).wait()
        self.host.stop()

    def wait(self) -> None:
        self.server.wait_for_termination()

    def __enter__(self) -> DaemonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=1.0)


def serve(server: DaemonServer, *, grace: float = 5.0) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        done.wait()
    finally:
        server.stop(grace)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
