"""A simulated slow link between nodes: a `wrapper=True` communicate hook that makes every op
the backend carries out cost `inter-node bytes / bandwidth` seconds on the rank that sends them.

The bytes are the comm layer's own (`plait.core.link_bytes.op_link_bytes` on the op as issued,
with the host map), so an algorithm that sends fewer bytes across nodes — hierarchical
collectives, HSDP, ZeRO++'s codecs — pays proportionally less. The op is waited for before the
delay, so the cost lands where a saturated link would put it: between the op's start and the
moment its result is usable. Ops carried out by an algorithm over sub-ops are charged through
those sub-ops (each reaches the backend and this hook), never twice. For benchmarks
(`tools/bench/topology.py`) on one machine whose "nodes" share memory::

    link = SlowCrossNodeLink(bytes_per_second=50e6)
    engine = Engine(config=..., plugins=Plugins.create(extra=[("slow_link", link)]))
    link.host_map = engine.mesh.host_map
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

from plait.core.comm import BACKEND, CARRIED_BY
from plait.core.hookspecs import hookimpl
from plait.core.host_map import HostMap
from plait.core.link_bytes import op_link_bytes, request_numel, request_peer_bytes
from plait.core.records import CommRequest

__all__ = ["SlowCrossNodeLink"]


class SlowCrossNodeLink:
    """Charges each backend op's cross-node bytes at `bytes_per_second` (0: free, counting
    only); `inter_node_bytes` and `seconds` add up what this rank sent and waited."""

    def __init__(self, *, bytes_per_second: float, host_map: HostMap | None = None) -> None:
        self.bytes_per_second = bytes_per_second
        self.host_map = host_map
        self.inter_node_bytes = 0
        self.seconds = 0.0

    def _inter_node(self, request: CommRequest, rank: int) -> int:
        if self.host_map is None or not request.tensors or rank not in request.group_ranks:
            return 0
        sent = op_link_bytes(
            request.op, request.group_ranks, rank, numel=request_numel(request),
            itemsize=request.tensors[0].element_size(), host_map=self.host_map,
            algorithm=BACKEND, peer=request.peer, bytes_per_peer=request_peer_bytes(request),
        )  # fmt: skip
        return sent.inter_node if sent is not None else 0

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: CommRequest) -> Generator[None, Any, Any]:
        work = yield
        if request.attributes.get(CARRIED_BY) != BACKEND:
            return work
        import torch.distributed as dist

        nbytes = self._inter_node(request, dist.get_rank())
        if nbytes:
            self.inter_node_bytes += nbytes
            if self.bytes_per_second > 0:
                work.wait()
                delay = nbytes / self.bytes_per_second
                time.sleep(delay)
                self.seconds += delay
        return work
