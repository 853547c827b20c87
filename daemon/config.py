"""`DaemonConfig`: every setting of a node daemon, shared by `DaemonServer` and `plait daemon`.

Collaborators that are objects rather than settings (an NVML collector, a retry policy for
tests) are passed to `DaemonServer` beside the config. This module imports nothing heavy, so the
CLI can build a config before it loads gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.daemon.control import ControlLimits
    from plait.daemon.lighthouse import LighthouseSettings
    from plait.daemon.security import SecurityConfig

DEFAULT_DAEMON_ADDRESS = "127.0.0.1:7461"  # as plait.daemon.address.DEFAULT_DAEMON_ADDRESS
DEFAULT_WINDOW_STEPS = 512
DEFAULT_WINDOW_SPANS = 50_000
DEFAULT_INGEST_CAPACITY = 200_000
DEFAULT_HANG_TIMEOUT_SECONDS = 60.0
DEFAULT_STRAGGLER_THRESHOLD = 0.2
# Steps averaged per rank when a query names no window (`plait top`, `bottleneck`, the page).
DEFAULT_METRICS_WINDOW_STEPS = 20
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # largest request accepted (a rank's batch is ~2 MiB)
# Trace requests at least this large go to an ingest worker when there are workers; a request
# this large holds a couple of hundred spans (plait's exporter writes ~150 bytes per span).
DEFAULT_INGEST_OFFLOAD_BYTES = 32 * 1024
# Ranks exporting nothing for longer than the floor are stale whatever their step time: metric
# heartbeats (every second by default) keep a live rank heard from far more often.
DEFAULT_STALE_FLOOR_SECONDS = 10.0
DEFAULT_STALE_STEP_MULTIPLE = 3.0
DEFAULT_STALE_CEILING_SECONDS = 600.0


@dataclass
class DaemonConfig:
    """What a daemon listens on, keeps, checks and exports."""

    bind: str = DEFAULT_DAEMON_ADDRESS
    # The rolling window kept per rank.
    window_steps: int = DEFAULT_WINDOW_STEPS
    window_spans: int = DEFAULT_WINDOW_SPANS
    reflection_enabled: bool = True
    host_interval: float = 1.0  # seconds between host (CPU, memory, network) samples
    gpu_interval: float = 1.0  # seconds between NVML samples
    max_workers: int = 64  # gRPC server threads
    security: SecurityConfig | None = None  # None: loopback without TLS or token
    max_message_bytes: int = MAX_MESSAGE_BYTES
    ingest_capacity: int = DEFAULT_INGEST_CAPACITY  # spans + metric points stored at once
    # Worker processes decoding large trace requests (`plait.daemon.ingest_pool`); 0: the daemon
    # decodes every request itself, on one core.
    ingest_workers: int = 0
    ingest_offload_bytes: int = DEFAULT_INGEST_OFFLOAD_BYTES  # smaller requests: decoded here
    max_streams: int | None = None  # long-lived calls at once (None: 3/4 of the workers)
    hang_timeout: float = DEFAULT_HANG_TIMEOUT_SECONDS
    straggler_threshold: float = DEFAULT_STRAGGLER_THRESHOLD
    # A silent rank is stale after max(stale_step_multiple × its median step, stale_floor),
    # at most stale_ceiling (seconds).
    stale_floor: float = DEFAULT_STALE_FLOOR_SECONDS
    stale_step_multiple: float = DEFAULT_STALE_STEP_MULTIPLE
    stale_ceiling: float = DEFAULT_STALE_CEILING_SECONDS
    # Upstream OTLP: "" forwards to $OTEL_EXPORTER_OTLP_ENDPOINT; None forwards nowhere.
    otlp_endpoint: str | None = None
    otlp_insecure: bool | None = None
    otlp_queue_bytes: int | None = None
    prometheus: str | None = None  # "host:port" serving /metrics; None: not served
    web: str | None = None  # "host:port" serving the live web page; None: not served
    web_interval: float = 1.0  # seconds between the page's live updates
    # What the control channel allows (capture sizes, durations, concurrency); None: defaults.
    control: ControlLimits | None = None
    # torchft's lighthouse for fault-tolerant jobs' replica groups; None: not hosted.
    lighthouse: LighthouseSettings | None = None

    def __post_init__(self) -> None:
        for name in ("window_steps", "window_spans", "max_workers", "ingest_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"daemon {name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "host_interval",
            "gpu_interval",
            "hang_timeout",
            "stale_floor",
            "web_interval",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"daemon {name} must be > 0 seconds, got {getattr(self, name)}")
        if self.stale_ceiling < self.stale_floor:
            raise ValueError(
                f"daemon stale_ceiling ({self.stale_ceiling}) must be >= stale_floor "
                f"({self.stale_floor})"
            )
        for name in ("ingest_workers", "ingest_offload_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"daemon {name} must be >= 0, got {getattr(self, name)}")
        if self.stale_step_multiple < 0 or self.straggler_threshold < 0:
            raise ValueError("daemon stale_step_multiple and straggler_threshold must be >= 0")
