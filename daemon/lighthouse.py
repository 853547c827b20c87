"""The torchft lighthouse a daemon hosts (`plait daemon --lighthouse HOST:PORT`).

The lighthouse forms the quorum of a fault-tolerant job's replica groups every step (see
`plait.plugins.fault_tolerance`). It is torchft's own server, run inside the daemon's process so
one process per node answers operators and groups alike. It speaks plain gRPC with neither TLS
nor a token, so it listens on loopback unless the operator says the network is trusted.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from plait.daemon.security import SecurityError, bind_host, is_loopback

DEFAULT_JOIN_TIMEOUT_SECONDS = 60.0
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LighthouseSettings:
    """Where the lighthouse listens and how long it waits for groups.

    `join_timeout_seconds`: how long a quorum waits for a live group that has not asked yet.
    `heartbeat_timeout_seconds`: how long a group may stay silent before it is left out."""

    bind: str
    min_replicas: int = 1
    join_timeout_seconds: float = DEFAULT_JOIN_TIMEOUT_SECONDS
    heartbeat_timeout_seconds: float = DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"lighthouse min_replicas must be >= 1, got {self.min_replicas}")
        for name in ("join_timeout_seconds", "heartbeat_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"lighthouse {name} must be > 0, got {getattr(self, name)}")
        if not is_loopback(self.bind) and not self.insecure:
            raise SecurityError(
                f"lighthouse bind {self.bind!r} is not loopback, and torchft's lighthouse has "
                "no TLS or token; pass --insecure to listen on a trusted network"
            )


class HostedLighthouse:
    """torchft's `LighthouseServer`, started on `settings.bind`; `address` is HOST:PORT."""

    def __init__(self, settings: LighthouseSettings) -> None:
        try:
            from torchft._torchft import LighthouseServer
        except ImportError:
            raise RuntimeError(
                "--lighthouse needs torchft; install the extra: pip install 'plait[ft]'"
            ) from None
        self.settings = settings
        self._server: Any = LighthouseServer(
            bind=settings.bind,
            min_replicas=settings.min_replicas,
            join_timeout_ms=int(settings.join_timeout_seconds * 1000),
            heartbeat_timeout_ms=int(settings.heartbeat_timeout_seconds * 1000),
        )
        # torchft reports the machine's name; groups dial the host the operator bound.
        port = str(self._server.address()).rsplit(":", 1)[1]
        host = bind_host(settings.bind)
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def stop(self) -> None:
        self._server.shutdown()


# Rust's `Duration` debug format: "812ns", "3.5µs", "2.69ms", "1.002s".
_HEARTBEAT_LINE = re.compile(r"^\s*(\S+): seen ([0-9.]+)(ns|µs|us|ms|s) ago", re.MULTILINE)
_SECONDS_PER_UNIT = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_QUORUM_ID_LINE = re.compile(r"Current quorum_id: (-?\d+)")
_WAITING = re.compile(r"\[(\d+)/(\d+) participants healthy\]")
# A member of the previous quorum: its replica id in bold, then the step it asked at.
_MEMBER = re.compile(r"<b>([^<]+)</b>\s*<br/?>\s*Step:\s*(-?\d+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class LighthouseView:
    """What a lighthouse reports of itself: the current quorum id, every replica group it hears
    heartbeats from (replica id → seconds since the last one), how many groups have asked for
    the next quorum and wait for it, that quorum's status, and the members of the last quorum
    it formed (replica id → the step it asked at), kept after they died."""

    quorum_id: int
    heartbeats: dict[str, float]
    waiting: int
    next_quorum: str
    previous_quorum: dict[str, int] = field(default_factory=dict)


# plait names a group `<job>-group<N>` (`plait.plugins.fault_tolerance.replica_group`); torchft
# appends ":<uuid>" for every start.
_PLAIT_REPLICA_ID = re.compile(r"^(?P<job>.+)-group(?P<group>\d+)(?::.*)?$")


def parse_replica_id(replica_id: str) -> tuple[str, int] | None:
    """(job id, replica group) of a plait group's replica id; None for another producer's."""
    match = _PLAIT_REPLICA_ID.match(replica_id)
    if match is None:
        return None
    return match.group("job"), int(match.group("group"))


def read_lighthouse(address: str, *, timeout: float = 5.0) -> LighthouseView:
    """Ask the lighthouse at HOST:PORT for its status page and read it (torchft 0.2's format)."""
    url = address if "://" in address else f"http://{address}"
    with urllib.request.urlopen(f"{url}/status", timeout=timeout) as response:
        return parse_lighthouse_status(response.read().decode("utf-8", "replace"))


def parse_lighthouse_status(page: str) -> LighthouseView:
    """A lighthouse's `/status` page (torchft 0.2's HTML fragment), read."""
    quorum = _QUORUM_ID_LINE.search(page)
    status = re.search(r"Next quorum status: ([^<\n]*)", page)
    waiting = _WAITING.search(page)
    return LighthouseView(
        quorum_id=int(quorum.group(1)) if quorum else -1,
        heartbeats={
            replica: float(age) * _SECONDS_PER_UNIT[unit]
            for replica, age, unit in _HEARTBEAT_LINE.findall(page)
        },
        waiting=int(waiting.group(2)) if waiting else 0,
        next_quorum=status.group(1).strip() if status else "",
        previous_quorum={
            replica: int(step) for replica, step in _MEMBER.findall(_previous_quorum(page))
        },
    )


def _previous_quorum(page: str) -> str:
    """The page's "Previous Quorum" section (up to the heartbeats), or "" before any."""
    start = page.find("Previous Quorum")
    if start < 0:
        return ""
    end = page.find("Heartbeats", start)
    return page[start : end if end >= 0 else len(page)]
