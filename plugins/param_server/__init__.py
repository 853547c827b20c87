"""A colocated parameter server for data-parallel gradient buckets, sync or bounded-staleness.

Selected with `[comm] algorithm = "param_server"` and configured in `[comm.param_server]`
(`mode = "sync" | "async"`, `staleness`, `num_servers`). The plugin takes over all-reduces with
purpose `"grad_bucket"` (sum or avg) and carries each out as a push/pull round through the same
`Comm` (see `server.py` for the protocol and why every rank is both worker and server).

Why colocated: plait launches one process per device and every process trains, so dedicated
server processes would idle devices; BytePS made the same choice for its colocated mode. With
`num_servers = k < world size` only the first `k` ranks serve, which concentrates traffic on them
the way a classic parameter-server deployment does.

In async mode rounds stay in flight between steps, so the engine must call `plait_job_end`
(it does on close) to drain them before the process group is destroyed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch.distributed as dist

from plait.core.comm import CompletedWork, Work
from plait.core.config import PlaitConfig
from plait.core.hookspecs import hookimpl
from plait.core.records import CommAlgorithmRecord, CommRequest
from plait.plugins.collectives.config import CommConfig, ParamServerConfig
from plait.plugins.collectives.p2p import CommBinding, group_of, sub_purpose
from plait.plugins.param_server.server import BucketChannel, ServerLayout, drain, push_pull

__all__ = ["ParamServerPlugin", "make_plugin"]

NAME = "param_server"
GRAD_BUCKET = "grad_bucket"


class ParamServerPlugin(CommBinding):
    """Answers `plait_communicate` for gradient-bucket all-reduces with push/pull rounds."""

    plugin_name = NAME

    def __init__(self, config: CommConfig | None = None) -> None:
        super().__init__()
        self.config = config or CommConfig()
        self.channels: dict[Hashable, tuple[ServerLayout, BucketChannel]] = {}

    @hookimpl
    def plait_configure(self, config: PlaitConfig) -> None:
        self.config = CommConfig.model_validate(
            {"algorithm": config.comm.algorithm, **config.comm.option_tables}
        )

    @hookimpl
    def plait_register_comm_algorithms(self) -> Sequence[CommAlgorithmRecord]:
        return [
            CommAlgorithmRecord(
                name=NAME,
                ops=("all_reduce",),
                config_cls=ParamServerConfig,
                description="colocated parameter server, synchronous or bounded staleness",
            )
        ]

    @hookimpl
    def plait_communicate(self, request: CommRequest) -> Work | None:
        if (
            self.config.algorithm != NAME
            or request.op != "all_reduce"
            or request.purpose != GRAD_BUCKET
            or request.reduce_op not in ("sum", "avg")
        ):
            return None
        (tensor,) = request.tensors
        settings = self.config.param_server
        group = group_of(request)
        num_servers = min(settings.num_servers or group.size, group.size)
        layout = ServerLayout(
            comm=self.comm_for(request),
            group=group,
            rank=dist.get_rank(),
            num_servers=num_servers,
            push_purpose=sub_purpose(NAME, f"{request.purpose}/push"),
            pull_purpose=sub_purpose(NAME, f"{request.purpose}/pull"),
        )
        index = request.attributes.get("bucket_index", (tuple(tensor.shape), str(tensor.dtype)))
        _, channel = self.channels.setdefault(
            (request.group_name, index), (layout, BucketChannel())
        )
        push_pull(
            layout,
            channel,
            tensor,
            reduce_op=request.reduce_op,
            staleness=settings.effective_staleness,
        )
        return CompletedWork()

    @hookimpl
    def plait_job_end(self) -> None:
        self.flush()

    def flush(self) -> None:
        """Complete every round still in flight, bucket by bucket in first-use order."""
        for layout, channel in self.channels.values():
            drain(layout, channel)


def make_plugin() -> ParamServerPlugin:
    return ParamServerPlugin()
