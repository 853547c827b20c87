"""Where a job's daemons are: the node list its ranks report, one per world and replica group.

Every rank of a job learns, once per world, each node's host name and the daemon address its
ranks export to (`plait.plugins.telemetry.job_nodes`); each node's first rank sends that list
to its own daemon with its first poll. So every daemon of a job holds the whole job's list
without any daemon talking to another, with no per-step traffic, whatever launched the job
(torchrun's static, c10d or etcd rendezvous, Slurm, Kubernetes): the list comes from the ranks,
not from the launcher.

**A new world replaces the old.** After an elastic restart the new world's first ranks report
again; the newest report of a (job, replica group) wins, so a node that left is no longer
asked. A fault-tolerant job's replica groups are worlds of their own: the job's daemons are
those of every group's latest report.

**Addresses are seen from here.** A rank reaches its daemon at the address it was given, often
loopback ("127.0.0.1:50051" while the daemon listens on every interface). That address is good
from the rank's own host; from another host the node's host name takes loopback's place.
"""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass

__all__ = ["JobDirectory", "JobNode", "WorldReport", "seen_from"]

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


@dataclass(frozen=True, slots=True)
class JobNode:
    """One node of a job: its index in the host map, host name, daemon address, ranks."""

    node: int
    host: str
    daemon: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WorldReport:
    """The nodes of one world of a job (one replica group of a fault-tolerant job)."""

    job_id: str
    replica_group: int  # NO_REPLICA_GROUP (-1) outside fault tolerance
    nodes: tuple[JobNode, ...]
    here: int  # the node of the rank that reported it (this daemon's node)
    reported_unix_nano: int


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def seen_from(node: JobNode, here: str) -> str:
    """`node`'s daemon address as a daemon or CLI on host `here` reaches it: a loopback address
    of another host becomes that host's name with the same port."""
    host, sep, port = node.daemon.rpartition(":")
    if not sep or not _is_loopback(host) or node.host == here or not node.host:
        return node.daemon
    return f"{node.host}:{port}"


class JobDirectory:
    """The latest world report of every (job, replica group); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[tuple[str, int], WorldReport] = {}

    def report(self, report: WorldReport) -> None:
        with self._lock:
            self._reports[(report.job_id, report.replica_group)] = report

    def knows(self, job_id: str, replica_group: int) -> bool:
        with self._lock:
            return (job_id, replica_group) in self._reports

    def reports(self, job_id: str) -> list[WorldReport]:
        """The job's latest report per replica group, groups ascending."""
        with self._lock:
            return [r for (job, _), r in sorted(self._reports.items()) if job == job_id]

    def job_ids(self) -> list[str]:
        with self._lock:
            return sorted({job for job, _ in self._reports})
