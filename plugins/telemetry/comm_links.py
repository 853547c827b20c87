"""What carried each op out and the bytes it sent per link class, for the comm spans.

The telemetry wrapper asks `CommLinks.note(request, record)` once the hook chain has run (an
algorithm marks the request it takes over, the backend the ones that reach it) and the record
gets the name and `plait.core.link_bytes`' figures under that algorithm's model. A step issues
the same ops again and again, so figures are cached by what decides them: the steady-state cost
on the training thread is one dictionary lookup per op.
"""

from __future__ import annotations

from typing import Any

from plait.core.comm import CARRIED_BY
from plait.core.host_map import HostMap
from plait.core.link_bytes import LinkBytes, op_link_bytes, request_numel, request_peer_bytes
from plait.core.records import CommRequest
from plait.plugins.telemetry.comm_records import CommRecord

MAX_CACHED = 4096


class CommLinks:
    """This rank's byte model: its rank and the world's host map (None: no link bytes)."""

    def __init__(self, rank: int, host_map: HostMap | None) -> None:
        self.rank = rank
        self.host_map = host_map
        self._cache: dict[tuple[Any, ...], LinkBytes | None] = {}

    def note(self, request: CommRequest, record: CommRecord) -> None:
        algorithm = request.attributes.get(CARRIED_BY, "")
        record.algorithm = algorithm
        if self.host_map is None or not algorithm:
            return
        first = request.tensors[0] if request.tensors else None
        record.links = self.bytes_for(
            request.op,
            request.group_ranks,
            numel=request_numel(request),
            itemsize=first.element_size() if first is not None else 0,
            algorithm=algorithm,
            peer=request.peer,
            peer_bytes=request_peer_bytes(request),
        )

    def bytes_for(
        self,
        op: str,
        group_ranks: tuple[int, ...],
        *,
        numel: int,
        itemsize: int,
        algorithm: str,
        peer: int | None = None,
        peer_bytes: tuple[int, ...] | None = None,
    ) -> LinkBytes | None:
        """What this rank sends per link class for one op (cached by what decides it)."""
        if self.host_map is None:
            return None
        key = (op, numel, itemsize, group_ranks, peer, algorithm, peer_bytes)
        links = self._cache.get(key, self)
        if links is self:
            links = op_link_bytes(
                op,
                group_ranks,
                self.rank,
                numel=numel,
                itemsize=itemsize,
                host_map=self.host_map,
                algorithm=algorithm,
                peer=peer,
                bytes_per_peer=peer_bytes,
            )
            if len(self._cache) < MAX_CACHED:
                self._cache[key] = links
        return links
