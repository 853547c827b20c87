"""What the page shows: `plait top --json` and `plait bottleneck --json` for this daemon, its hangs.

Nothing here computes a figure. The daemon's services are asked in-process (the same methods
the gRPC server calls, with `LocalContext` standing in for a call's context), and their answers
go through the very functions that build the CLI's documents (`TopView`, `top_document`,
`bottleneck_view`, `bottleneck_document`, `merge_hangs`), so a number on the page and the same
number printed by `plait top --json --host <this daemon>` are one computation. The window and
the straggler threshold are the CLI's defaults, so both ask the same question.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from plait.daemon.hangs import merge_hangs
from plait.daemon.local_calls import LocalContext
from plait.daemon.service import DaemonService
from plait.proto.plait.v1 import daemon_pb2
from plait.tools.daemon_commands import (
    bottleneck_document,
    bottleneck_view,
    top_document,
)
from plait.tools.daemon_views import TopView

# `plait top`'s and `plait bottleneck`'s default --window-steps.
WINDOW_STEPS = 20


@dataclass(frozen=True, slots=True)
class PageSource:
    """Where the page's figures come from: this daemon's service, as it is addressed."""

    service: DaemonService
    address: str  # what `plait top --host` would be given
    straggler_threshold: float

    def document(self) -> dict[str, Any]:
        """The page's whole content now (see the module docstring for where each part is from)."""
        context: Any = LocalContext()
        service = self.service
        metrics = service.GetMetrics(
            daemon_pb2.GetMetricsRequest(window_steps=WINDOW_STEPS), context
        )
        top = top_document(TopView.from_latest({self.address: metrics}))
        answers = (
            service.GetBottleneck(
                daemon_pb2.GetBottleneckRequest(
                    window_steps=WINDOW_STEPS, straggler_threshold=self.straggler_threshold
                ),
                context,
            ),
            service.ListRanks(daemon_pb2.ListRanksRequest(), context),
            metrics,
        )
        breakdown, _ = bottleneck_view({self.address: answers}, self.straggler_threshold)
        return {
            "address": self.address,
            "computed_unix_nano": metrics.computed_unix_nano,
            "window_steps": WINDOW_STEPS,
            "top": top,
            "bottleneck": bottleneck_document(breakdown, None),
            "hangs": [asdict(h) for h in merge_hangs(service.hangs())],
        }
