"""Collective algorithms over point-to-point ops: ring and recursive halving-doubling all-reduce.

Selected with `[comm] algorithm = "ring"` or `"tree"`, options in `[comm.ring]` / `[comm.tree]`
(`plait.plugins.collectives.config`). When selected, the plugin takes over every `all_reduce`
and every gradient `reduce_scatter` (ZeRO-2/3's path on GPU) — or only those whose purpose is
listed in `purposes` — and carries it out as send/recv steps through the issuing `Comm`, which
is how a third party can swap the backend's collective for its own algorithm without touching
any strategy.

Asynchronous requests (gradient buckets) return at once: the steps run on the group's worker
thread over a dedicated process group (`plait.core.comm_algorithms.AlgorithmRunner`), so the
backward pass keeps running while buckets reduce. Synchronous requests are complete on return.

`make_plugin()` returns a fresh plugin object per plugin manager (one per engine).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from pydantic import BaseModel

from plait.core.comm import Comm, Group, Work
from plait.core.comm_algorithms import (
    GRADIENT_PURPOSES,
    AlgorithmRunner,
    CommBinding,
    is_sub_op,
    reduce_scatter_by_all_reduce,
    sub_purpose,
)
from plait.core.config import PlaitConfig
from plait.core.hookspecs import hookimpl
from plait.core.records import CommAlgorithmRecord, CommRequest
from plait.plugins.collectives.config import RingConfig, TreeConfig
from plait.plugins.collectives.ring import ring_all_reduce, ring_reduce_scatter
from plait.plugins.collectives.tree import halving_doubling_all_reduce

__all__ = ["CollectivesPlugin", "RingConfig", "TreeConfig", "make_plugin"]

CONFIG_CLASSES: dict[str, type[RingConfig] | type[TreeConfig]] = {
    "ring": RingConfig,
    "tree": TreeConfig,
}


class CollectivesPlugin(CommBinding):
    """Answers `plait_communicate` for all-reduces (and gradient reduce-scatters) when
    `comm.algorithm` is ring or tree."""

    plugin_name = "collectives"

    def __init__(self, algorithm: str = "torch", options: BaseModel | None = None) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.options: RingConfig | TreeConfig = (
            options if isinstance(options, RingConfig | TreeConfig) else self._defaults()
        )
        self.runner = AlgorithmRunner(algorithm)

    def _defaults(self) -> RingConfig | TreeConfig:
        return CONFIG_CLASSES.get(self.algorithm, RingConfig)()

    @hookimpl
    def plait_configure(self, config: PlaitConfig) -> None:
        self.algorithm = config.comm.algorithm
        if self.algorithm not in CONFIG_CLASSES:
            return
        self.options = config.comm.options(self.algorithm, CONFIG_CLASSES[self.algorithm])
        self.runner = AlgorithmRunner(self.algorithm)
        self.runner.dedicate_for(config)

    @hookimpl
    def plait_register_comm_algorithms(self) -> Sequence[CommAlgorithmRecord]:
        return [
            CommAlgorithmRecord(
                name="ring",
                ops=("all_reduce", "reduce_scatter"),
                config_cls=RingConfig,
                description="ring reduce-scatter + all-gather over send/recv",
            ),
            CommAlgorithmRecord(
                name="tree",
                ops=("all_reduce", "reduce_scatter"),
                config_cls=TreeConfig,
                description="recursive halving-doubling (Rabenseifner) over send/recv",
            ),
        ]

    def takes_over(self, request: CommRequest) -> bool:
        if self.algorithm not in CONFIG_CLASSES or is_sub_op(request.purpose):
            return False
        if request.op == "reduce_scatter":
            wanted = request.purpose in GRADIENT_PURPOSES
        else:
            wanted = request.op == "all_reduce"
        purposes = self.options.purposes
        return wanted and (not purposes or request.purpose in purposes)

    @hookimpl
    def plait_communicate(self, request: CommRequest) -> Work | None:
        if not self.takes_over(request):
            return None
        comm = self.comm_for(request)
        purpose = sub_purpose(self.algorithm, request.purpose)
        rank = dist.get_rank()

        def all_reduce(comm: Comm, group: Group, tensor: torch.Tensor) -> None:
            if isinstance(self.options, TreeConfig):
                halving_doubling_all_reduce(
                    comm,
                    tensor,
                    group=group,
                    rank=rank,
                    reduce_op=request.reduce_op,
                    purpose=purpose,
                    small_message_bytes=self.options.small_message_bytes,
                )
            else:
                ring_all_reduce(
                    comm, tensor, group=group, rank=rank, reduce_op=request.reduce_op,
                    purpose=purpose, piece_bytes=self.options.piece_bytes,
                )  # fmt: skip

        def steps(comm: Comm, group: Group) -> None:
            if request.op == "all_reduce":
                all_reduce(comm, group, request.tensors[0])
            elif isinstance(self.options, TreeConfig):
                reduce_scatter_by_all_reduce(request, group, lambda t: all_reduce(comm, group, t))
            else:
                output, source = request.tensors
                ring_reduce_scatter(
                    comm, output, source, group=group, rank=rank, reduce_op=request.reduce_op,
                    purpose=purpose, piece_bytes=self.options.piece_bytes,
                )  # fmt: skip

        return self.runner.run(request, steps, comm)

    @hookimpl
    def plait_job_end(self) -> None:
        self.runner.close()


def make_plugin() -> CollectivesPlugin:
    return CollectivesPlugin()
