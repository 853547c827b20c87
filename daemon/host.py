"""Host collector: the node's CPU, memory and network use, and each local rank process's usage.

Sampled with psutil on a background thread every `interval` seconds; queries read the last
sample, so an RPC never waits on /proc. GPU metrics come from the NVML collector, not here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from plait.core.host import host_name
from plait.daemon.store import RankKey


@dataclass(frozen=True, slots=True)
class ProcessSample:
    cpu_percent: float
    rss_bytes: int


@dataclass(frozen=True, slots=True)
class HostSample:
    hostname: str
    cpu_percent: float
    cpu_count: int
    memory_used_bytes: int
    memory_total_bytes: int
    net_bytes_sent: int
    net_bytes_recv: int
    net_sent_bytes_per_second: float
    net_recv_bytes_per_second: float
    sampled_ns: int
    processes: dict[RankKey, ProcessSample] = field(default_factory=dict)


class HostCollector:
    """Samples the host and the processes `pids()` names, every `interval` seconds."""

    def __init__(self, pids: Callable[[str], dict[RankKey, int]], *, interval: float = 1.0) -> None:
        self.hostname = host_name()  # the name the ranks of this node report
        self.interval = interval
        self._pids = pids
        self._processes: dict[int, psutil.Process] = {}
        self._previous_net: tuple[int, int, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        psutil.cpu_percent(interval=None)  # the first call only sets the reference point
        self.latest = self.sample()

    def sample(self) -> HostSample:
        now = time.monotonic()
        memory = psutil.virtual_memory()
        net = psutil.net_io_counters()
        sent_rate = recv_rate = 0.0
        if self._previous_net is not None:
            sent, recv, then = self._previous_net
            elapsed = max(now - then, 1e-9)
            sent_rate = (net.bytes_sent - sent) / elapsed
            recv_rate = (net.bytes_recv - recv) / elapsed
        self._previous_net = (net.bytes_sent, net.bytes_recv, now)
        return HostSample(
            hostname=self.hostname,
            cpu_percent=psutil.cpu_percent(interval=None),
            cpu_count=psutil.cpu_count() or 0,
            memory_used_bytes=memory.total - memory.available,
            memory_total_bytes=memory.total,
            net_bytes_sent=net.bytes_sent,
            net_bytes_recv=net.bytes_recv,
            net_sent_bytes_per_second=sent_rate,
            net_recv_bytes_per_second=recv_rate,
            sampled_ns=time.time_ns(),
            processes=self._sample_processes(),
        )

    def _sample_processes(self) -> dict[RankKey, ProcessSample]:
        samples: dict[RankKey, ProcessSample] = {}
        wanted = self._pids(self.hostname)
        for key, pid in wanted.items():
            process = self._processes.get(pid)
            try:
                if process is None:
                    process = self._processes[pid] = psutil.Process(pid)
                    process.cpu_percent(None)  # reference point; the next sample is real
                with process.oneshot():
                    samples[key] = ProcessSample(
                        cpu_percent=process.cpu_percent(None),
                        rss_bytes=process.memory_info().rss,
                    )
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                self._processes.pop(pid, None)
        live = set(wanted.values())
        for pid in [p for p in self._processes if p not in live]:
            del self._processes[pid]
        return samples

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.latest = self.sample()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="plait-host-collector", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
