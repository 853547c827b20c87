"""Collective algorithms over point-to-point ops: ring and recursive halving-doubling all-reduce.

Selected with `[comm] algorithm = "ring"` or `"tree"`. When selected, the plugin takes over every
`all_reduce` (or only the purposes listed in `[comm.ring] purposes` / `[comm.tree] purposes`) and
carries it out as send/recv steps through the same `Comm`, which is how a third party can swap
the backend's collective for its own algorithm without touching any strategy.

The ops run synchronously inside the hook and return a completed handle: on Gloo the individual
sends and receives are already asynchronous, and keeping the whole collective on the caller's
thread keeps the order of ops identical on every rank.

`make_plugin()` returns a fresh plugin object per plugin manager (one per engine).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from plait.core.comm import CompletedWork, Work
from plait.core.config import PlaitConfig
from plait.core.hookspecs import hookimpl
from plait.core.records import CommAlgorithmRecord, CommRequest
from plait.plugins.collectives.config import CommConfig, RingConfig, TreeConfig
from plait.plugins.collectives.p2p import CommBinding, group_of, is_sub_op, sub_purpose
from plait.plugins.collectives.ring import ring_all_reduce
from plait.plugins.collectives.tree import halving_doubling_all_reduce

__all__ = ["CollectivesPlugin", "make_plugin"]

ALGORITHMS = ("ring", "tree")


class CollectivesPlugin(CommBinding):
    """Answers `plait_communicate` for all-reduces when `comm.algorithm` is ring or tree."""

    plugin_name = "collectives"

    def __init__(self, config: CommConfig | None = None) -> None:
        super().__init__()
        self.config = config or CommConfig()

    @hookimpl
    def plait_configure(self, config: PlaitConfig) -> None:
        self.config = CommConfig.model_validate(
            {"algorithm": config.comm.algorithm, **config.comm.option_tables}
        )

    @hookimpl
    def plait_register_comm_algorithms(self) -> Sequence[CommAlgorithmRecord]:
        return [
            CommAlgorithmRecord(
                name="ring",
                ops=("all_reduce",),
                config_cls=RingConfig,
                description="ring reduce-scatter + all-gather over send/recv",
            ),
            CommAlgorithmRecord(
                name="tree",
                ops=("all_reduce",),
                config_cls=TreeConfig,
                description="recursive halving-doubling (Rabenseifner) over send/recv",
            ),
        ]

    @hookimpl
    def plait_communicate(self, request: CommRequest) -> Work | None:
        algorithm = self.config.algorithm
        if algorithm not in ALGORITHMS or request.op != "all_reduce":
            return None
        if is_sub_op(request.purpose, ALGORITHMS):
            return None
        purposes = self.config.ring.purposes if algorithm == "ring" else self.config.tree.purposes
        if purposes and request.purpose not in purposes:
            return None
        comm = self.comm_for(request)
        (tensor,) = request.tensors
        group = group_of(request)
        purpose = sub_purpose(algorithm, request.purpose)
        rank = dist.get_rank()
        if algorithm == "ring":
            ring_all_reduce(
                comm, tensor, group=group, rank=rank, reduce_op=request.reduce_op, purpose=purpose
            )
        else:
            halving_doubling_all_reduce(
                comm,
                tensor,
                group=group,
                rank=rank,
                reduce_op=request.reduce_op,
                purpose=purpose,
                small_message_bytes=self.config.tree.small_message_bytes,
            )
        return CompletedWork()


def make_plugin() -> CollectivesPlugin:
    return CollectivesPlugin()
