"""Gradient compression for data-parallel bucket reductions: fp16, bf16, PowerSGD, top-k.

Selected with `[comm] algorithm = "fp16" | "bf16" | "powersgd" | "topk"` and configured in the
matching `[comm.<name>]` table (`plait.plugins.compression.config`). The plugin takes over only
all-reduces and reduce-scatters (ZeRO-2/3's path on GPU) with purpose `GRAD_BUCKET` and reduce
op sum or avg; everything else (loss averaging, parameter broadcasts, its own sub-ops tagged
`"<name>/grad_bucket"`) passes through. A reduce-scatter is carried out as the compressed
all-reduce of a copy of the bucket, of which this rank keeps its chunk.

Asynchronous requests return at once and run on the group's worker thread over a dedicated
process group (`plait.core.comm_algorithms.AlgorithmRunner`), so backward keeps running while
buckets are compressed and reduced; synchronous ones are complete on return.

PowerSGD and top-k keep state per bucket (error feedback, the warm-start `Q`), keyed by the
group and the `bucket_index` the data-parallel strategy puts in `CommRequest.attributes`; a
request without one is keyed by its shape and dtype. `make_plugin()` therefore returns a fresh
plugin object per plugin manager, so two engines in one process never share residuals.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from pydantic import BaseModel

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
from plait.plugins.compression.cast import cast_all_reduce
from plait.plugins.compression.config import CastConfig, PowerSGDConfig, TopKConfig
from plait.plugins.compression.powersgd import PowerSGDState, powersgd_all_reduce
from plait.plugins.compression.topk import TopKState, topk_all_reduce

__all__ = [
    "CastConfig",
    "CompressionPlugin",
    "PowerSGDConfig",
    "TopKConfig",
    "make_plugin",
]

WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CONFIG_CLASSES: dict[str, type[BaseModel]] = {
    "fp16": CastConfig,
    "bf16": CastConfig,
    "powersgd": PowerSGDConfig,
    "topk": TopKConfig,
}


class CompressionPlugin(CommBinding):
    """Answers `plait_communicate` for gradient-bucket all-reduces with the configured codec."""

    plugin_name = "compression"

    def __init__(self, algorithm: str = "torch", options: BaseModel | None = None) -> None:
        super().__init__()
        self.algorithm = algorithm
        default = CONFIG_CLASSES.get(algorithm)
        self.options: Any = options if options is not None else (default() if default else None)
        self.runner = AlgorithmRunner(algorithm)
        self.powersgd_states: dict[Hashable, PowerSGDState] = {}
        self.topk_states: dict[Hashable, TopKState] = {}

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
                name="fp16",
                ops=("all_reduce", "reduce_scatter"),
                config_cls=CastConfig,
                description="gradient buckets all-reduced in float16 (2x fewer bytes)",
            ),
            CommAlgorithmRecord(
                name="bf16",
                ops=("all_reduce", "reduce_scatter"),
                config_cls=CastConfig,
                description="gradient buckets all-reduced in bfloat16 (2x fewer bytes)",
            ),
            CommAlgorithmRecord(
                name="powersgd",
                ops=("all_reduce", "reduce_scatter"),
                config_cls=PowerSGDConfig,
                description="rank-r PowerSGD with error feedback and warm start",
            ),
            CommAlgorithmRecord(
                name="topk",
                ops=("all_reduce", "reduce_scatter"),
                config_cls=TopKConfig,
                description="top-k sparsification with error feedback",
            ),
        ]

    def takes_over(self, request: CommRequest) -> bool:
        if (
            self.algorithm not in CONFIG_CLASSES
            or request.op not in ("all_reduce", "reduce_scatter")
            or request.purpose != GRAD_BUCKET
            or request.reduce_op not in ("sum", "avg")
        ):
            return False
        bucket = request.tensors[-1]  # the all-reduced tensor, or the reduce-scatter's input
        return bucket.is_floating_point() and bucket.numel() > 0

    @hookimpl
    def plait_communicate(self, request: CommRequest) -> Work | None:
        if not self.takes_over(request):
            return None
        key = bucket_key(request)

        def steps(comm: Comm, group: Group) -> None:
            if request.op == "all_reduce":
                self.all_reduce(comm, group, request.tensors[0], request=request, key=key)
            else:
                reduce_scatter_by_all_reduce(
                    request,
                    group,
                    lambda bucket: self.all_reduce(comm, group, bucket, request=request, key=key),
                )

        return self.runner.run(request, steps, self.comm_for(request))

    def all_reduce(
        self,
        comm: Comm,
        group: Group,
        tensor: torch.Tensor,
        *,
        request: CommRequest,
        key: Hashable,
    ) -> None:
        """The configured codec's all-reduce of `tensor`, in place, complete on return."""
        algorithm, options = self.algorithm, self.options
        purpose = sub_purpose(algorithm, request.purpose)
        if algorithm == "powersgd":
            powersgd_all_reduce(
                comm,
                tensor,
                state=self.powersgd_states.setdefault(key, PowerSGDState()),
                rank=options.rank,
                warm_start=options.warm_start,
                error_feedback=options.error_feedback,
                start_step=options.start_step,
                seed=options.seed,
                group=group,
                reduce_op=request.reduce_op,
                purpose=purpose,
            )
        elif algorithm == "topk":
            topk_all_reduce(
                comm,
                tensor,
                state=self.topk_states.setdefault(key, TopKState()),
                ratio=options.ratio,
                error_feedback=options.error_feedback,
                group=group,
                reduce_op=request.reduce_op,
                purpose=purpose,
            ).wait()
        else:
            cast_all_reduce(
                comm,
                tensor,
                wire_dtype=WIRE_DTYPES[algorithm],
                prescale=options.prescale,
                group=group,
                reduce_op=request.reduce_op,
                purpose=purpose,
            ).wait()

    @hookimpl
    def plait_job_end(self) -> None:
        self.runner.close()


def bucket_key(request: CommRequest) -> Hashable:
    """Which bucket's state a request uses: its `bucket_index`, else its shape and dtype."""
    bucket = request.tensors[-1]
    index = request.attributes.get("bucket_index")
    if index is not None:
        return (request.group_name, request.op, "bucket", index)
    return (request.group_name, request.op, "shape", tuple(bucket.shape), str(bucket.dtype))


def make_plugin() -> CompressionPlugin:
    return CompressionPlugin()
