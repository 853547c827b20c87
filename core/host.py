"""Facts about this host: its name as the ranks report it and the daemon shows it, its CPU, the
cores this process may use, and where plait caches what it measured here.

Containers and clusters often give hosts names that mean nothing to an operator (a pod id, a
VM's internal name). `PLAIT_HOST_NAME` sets the name; otherwise OpenTelemetry's own
`host.name` from `OTEL_RESOURCE_ATTRIBUTES` (as an operator's collector setup would set it);
otherwise the hostname.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

# Where measurements of this host are cached (CPU peak, kernel choices, Triton tiles, links).
CACHE_ENV = "PLAIT_CACHE_DIR"


def host_name(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    explicit = env.get("PLAIT_HOST_NAME", "").strip()
    if explicit:
        return explicit
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "host.name" and value.strip():
            return value.strip()
    return socket.gethostname()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def host_cores() -> int:
    """Cores this process may run on (a container's or `taskset`'s limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plait"
