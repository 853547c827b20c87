"""A traffic meter: a `wrapper=True` communicate hook that counts ops and bytes by purpose.

Register it next to an algorithm plugin to measure what the algorithm really puts on the wire.
It sees the op a strategy issued (e.g. a `"grad_bucket"` all-reduce) *and* every sub-op an
algorithm issues for it (`"powersgd/grad_bucket"` all-reduces, `"ring/grad_bucket"` sends), so
the bytes an algorithm moves are the bytes of the sub-ops, and those of the backend's own
collective are the bytes of the op itself::

    meter = TrafficMeter()
    plugins = Plugins.create(extra=[("traffic_meter", meter), ("compression", compression)])
    ...
    meter.bytes_for(lambda purpose: purpose.startswith("powersgd/"))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator
from typing import Any

from plait.core.hookspecs import hookimpl
from plait.core.records import CommRequest


class TrafficMeter:
    """Counts `request.nbytes` (what this rank contributes) per (op, purpose)."""

    def __init__(self) -> None:
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.ops: Counter[tuple[str, str]] = Counter()

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: CommRequest) -> Generator[None, Any, Any]:
        # A receive contributes nothing: counting it too would count every message twice.
        if request.op != "recv":
            self.bytes[(request.op, request.purpose)] += request.nbytes
        self.ops[(request.op, request.purpose)] += 1
        return (yield)

    def bytes_for(self, purpose: Callable[[str], bool], op: str | None = None) -> int:
        """Bytes of the ops whose purpose satisfies `purpose` (and whose op is `op`, if given)."""
        return sum(n for (o, p), n in self.bytes.items() if purpose(p) and (op is None or o == op))

    def reset(self) -> None:
        self.bytes.clear()
        self.ops.clear()
