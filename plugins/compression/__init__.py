"""Gradient compression for data-parallel bucket all-reduces: fp16, bf16, PowerSGD, top-k.

Selected with `[comm] algorithm = "fp16" | "bf16" | "powersgd" | "topk"` and configured in the
matching `[comm.<name>]` sub-table (see `plait.plugins.collectives.config`). The plugin takes over
only all-reduces with purpose `"grad_bucket"` and reduce op sum or avg; everything else (loss
averaging, parameter broadcasts, its own sub-ops tagged `"<name>/grad_bucket"`) passes through.

PowerSGD and top-k keep state per bucket (error feedback, the warm-start `Q`), keyed by the
group and the `bucket_index` the data-parallel strategy puts in `CommRequest.attributes`; a
request without one is keyed by its shape and dtype. `make_plugin()` therefore returns a fresh
plugin object per plugin manager, so two engines in one process never share residuals.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from plait.core.comm import CompletedWork, Work
from plait.core.config import PlaitConfig
from plait.core.hookspecs import hookimpl
from plait.core.records import CommAlgorithmRecord, CommRequest
from plait.plugins.collectives.config import (
    CastConfig,
    CommConfig,
    PowerSGDConfig,
    TopKConfig,
)
from plait.plugins.collectives.p2p import CommBinding, group_of, sub_purpose
from plait.plugins.compression.cast import cast_all_reduce
from plait.plugins.compression.powersgd import PowerSGDState, powersgd_all_reduce
from plait.plugins.compression.topk import TopKState, topk_all_reduce

__all__ = ["CompressionPlugin", "make_plugin"]

GRAD_BUCKET = "grad_bucket"
WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ALGORITHMS = ("fp16", "bf16", "powersgd", "topk")


class CompressionPlugin(CommBinding):
    """Answers `plait_communicate` for gradient-bucket all-reduces with the configured codec."""

    plugin_name = "compression"

    def __init__(self, config: CommConfig | None = None) -> None:
        super().__init__()
        self.config = config or CommConfig()
        self.powersgd_states: dict[Hashable, PowerSGDState] = {}
        self.topk_states: dict[Hashable, TopKState] = {}

    @hookimpl
    def plait_configure(self, config: PlaitConfig) -> None:
        self.config = CommConfig.model_validate(
            {"algorithm": config.comm.algorithm, **config.comm.option_tables}
        )

    @hookimpl
    def plait_register_comm_algorithms(self) -> Sequence[CommAlgorithmRecord]:
        return [
            CommAlgorithmRecord(
                name="fp16",
                ops=("all_reduce",),
                config_cls=CastConfig,
                description="gradient buckets all-reduced in float16 (2x fewer bytes)",
            ),
            CommAlgorithmRecord(
                name="bf16",
                ops=("all_reduce",),
                config_cls=CastConfig,
                description="gradient buckets all-reduced in bfloat16 (2x fewer bytes)",
            ),
            CommAlgorithmRecord(
                name="powersgd",
                ops=("all_reduce",),
                config_cls=PowerSGDConfig,
                description="rank-r PowerSGD with error feedback and warm start",
            ),
            CommAlgorithmRecord(
                name="topk",
                ops=("all_reduce",),
                config_cls=TopKConfig,
                description="top-k sparsification with error feedback",
            ),
        ]

    @hookimpl
    def plait_communicate(self, request: CommRequest) -> Work | None:
        algorithm = self.config.algorithm
        if (
            algorithm not in ALGORITHMS
            or request.op != "all_reduce"
            or request.purpose != GRAD_BUCKET
            or request.reduce_op not in ("sum", "avg")
        ):
            return None
        (tensor,) = request.tensors
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return None
        comm = self.comm_for(request)
        group = group_of(request)
        purpose = sub_purpose(algorithm, request.purpose)
        key = bucket_key(request)

        if algorithm == "powersgd":
            settings = self.config.powersgd
            powersgd_all_reduce(
                comm,
                tensor,
                state=self.powersgd_states.setdefault(key, PowerSGDState()),
                rank=settings.rank,
                warm_start=settings.warm_start,
                error_feedback=settings.error_feedback,
                start_step=settings.start_step,
                seed=settings.seed,
                group=group,
                reduce_op=request.reduce_op,
                purpose=purpose,
            )
            return CompletedWork()

        if algorithm == "topk":
            work = topk_all_reduce(
                comm,
                tensor,
                state=self.topk_states.setdefault(key, TopKState()),
                ratio=self.config.topk.ratio,
                error_feedback=self.config.topk.error_feedback,
                group=group,
                reduce_op=request.reduce_op,
                purpose=purpose,
            )
        else:
            cast_settings: CastConfig = getattr(self.config, algorithm)
            work = cast_all_reduce(
                comm,
                tensor,
                wire_dtype=WIRE_DTYPES[algorithm],
                prescale=cast_settings.prescale,
                group=group,
                reduce_op=request.reduce_op,
                purpose=purpose,
            )
        if request.async_op:
            return work
        work.wait()
        return CompletedWork()


def bucket_key(request: CommRequest) -> Hashable:
    """Which bucket's state a request uses: its `bucket_index`, else its shape and dtype."""
    (tensor,) = request.tensors
    index = request.attributes.get("bucket_index")
    if index is not None:
        return (request.group_name, "bucket", index)
    return (request.group_name, "shape", tuple(tensor.shape), str(tensor.dtype))


def make_plugin() -> CompressionPlugin:
    return CompressionPlugin()
