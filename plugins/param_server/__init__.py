"""A colocated parameter server for data-parallel gradient buckets, sync or bounded-staleness.

Selected with `[comm] algorithm = "param_server"` and configured in `[comm.param_server]`
(`mode = "sync" | "async"`, `staleness`, `num_servers`; `plait.plugins.param_server.config`).
The plugin takes over all-reduces and reduce-scatters (ZeRO-2/3's path on GPU) with purpose
`GRAD_BUCKET` (sum or avg) and carries each out as a push/pull round through the issuing `Comm`
(see `server.py` for the protocol and why every rank is both worker and server); a
reduce-scatter is a round on a copy of the bucket, of which this rank keeps its chunk.

Asynchronous requests return at once: rounds run on the group's worker thread over a dedicated
process group (`plait.core.comm_algorithms.AlgorithmRunner`), so backward keeps running.

Why colocated: plait launches one process per device and every process trains, so dedicated
server processes would idle devices; BytePS made the same choice for its colocated mode. With
`num_servers = k < world size` only the first `k` ranks serve, which concentrates traffic on them
the way a classic parameter-server deployment does.

In async mode rounds stay in flight between steps, so the engine must call `plait_job_end`
(it does on close) to drain them before the process group is destroyed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist

from plait.core.comm import Comm, Group, Work
from plait.core.comm_algorithms import (
    GRAD_BUCKET,
    AlgorithmRunner,
    CommBinding,
    reduce_scatter_by_all_reduce,
    sub_purpose,
)
from plait.core.config import PlaitConfig
from plait.core.hookspecs import hookimpl
from plait.core.records import CommAlgorithmRecord, CommRequest
from plait.plugins.param_server.config import ParamServerConfig
from plait.plugins.param_server.server import BucketChannel, ServerLayout, drain, push_pull

__all__ = ["ParamServerConfig", "ParamServerPlugin", "make_plugin"]

NAME = "param_server"


class ParamServerPlugin(CommBinding):
    """Answers `plait_communicate` for gradient-bucket all-reduces with push/pull rounds."""

    plugin_name = NAME

    def __init__(self, algorithm: str = "torch", options: ParamServerConfig | None = None) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.options = options or ParamServerConfig()
        self.runner = AlgorithmRunner(NAME)
        self.channels: dict[Hashable, tuple[ServerLayout, BucketChannel]] = {}

    @hookimpl
    def plait_configure(self, config: PlaitConfig) -> None:
        self.algorithm = config.comm.algorithm
        if self.algorithm != NAME:
            return
        self.options = config.comm.options(NAME, ParamServerConfig)
        self.runner = AlgorithmRunner(NAME)
        self.runner.dedicate_for(config)

    @hookimpl
    def plait_register_comm_algorithms(self) -> Sequence[CommAlgorithmRecord]:
        return [
            CommAlgorithmRecord(
                name=NAME,
                ops=("all_reduce", "reduce_scatter"),
                config_cls=ParamServerConfig,
                description="colocated parameter server, synchronous or bounded staleness",
            )
        ]

    def takes_over(self, request: CommRequest) -> bool:
        return (
            self.algorithm == NAME
            and request.op in ("all_reduce", "reduce_scatter")
            and request.purpose == GRAD_BUCKET
            and request.reduce_op in ("sum", "avg")
        )

    @hookimpl
    def plait_communicate(self, request: CommRequest) -> Work | None:
        if not self.takes_over(request):
            return None
        bucket = request.tensors[-1]
        index = request.attributes.get("bucket_index", (tuple(bucket.shape), str(bucket.dtype)))
        key = (request.group_name, request.op, index)

        def round_trip(comm: Comm, group: Group, tensor: torch.Tensor) -> None:
            if key not in self.channels:
                self.channels[key] = (self._layout(comm, group, request), BucketChannel())
            layout, channel = self.channels[key]
            push_pull(
                layout,
                channel,
                tensor,
                reduce_op=request.reduce_op,
                staleness=self.options.effective_staleness,
            )

        def steps(comm: Comm, group: Group) -> None:
            if request.op == "all_reduce":
                round_trip(comm, group, request.tensors[0])
            else:
                reduce_scatter_by_all_reduce(request, group, lambda t: round_trip(comm, group, t))

        return self.runner.run(request, steps, self.comm_for(request))

    def _layout(self, comm: Comm, group: Group, request: CommRequest) -> ServerLayout:
        num_servers = min(self.options.num_servers or group.size, group.size)
        return ServerLayout(
            comm=comm,
            group=group,
            rank=dist.get_rank(),
            num_servers=num_servers,
            push_purpose=sub_purpose(NAME, f"{request.purpose}/push"),
            pull_purpose=sub_purpose(NAME, f"{request.purpose}/pull"),
        )

    @hookimpl
    def plait_job_end(self) -> None:
        self.flush()
        self.runner.close()

    def flush(self) -> None:
        """Complete every round still in flight, bucket by bucket in first-use order, after the
        rounds queued on each group's worker."""
        for layout, channel in list(self.channels.values()):
            self.runner.call(
                layout.group.ranks,
                lambda _comm, _group, layout=layout, channel=channel: drain(layout, channel),
                layout.comm,
                layout.group,
            )


def make_plugin() -> ParamServerPlugin:
    return ParamServerPlugin()
