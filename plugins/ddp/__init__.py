"""The `ddp` data-parallel strategy: replicated parameters, bucketed gradient all-reduce.

Gradients live in flat per-bucket buffers (each `param.grad` is a view, as torch DDP's
`gradient_as_bucket_view`), a bucket's all-reduce is issued asynchronously from
post-accumulate-grad hooks as soon as its last gradient is ready, while backward is still
running, and in bucket order so every rank issues the same collectives in the same order.
Reductions are skipped on all but the last micro-batch of a step (gradient accumulation).
As in torch DDP, the first bucket is small (`first_bucket_mb`) so communication starts early,
and after the first step the buckets are re-cut in the order backward really produced the
gradients (`rebuild_buckets`), so no bucket waits on a gradient computed much later.
"""

from __future__ import annotations

from pydantic import Field
from torch import nn

from plait.core.config import Section
from plait.core.names import normalised_name
from plait.core.sharding import ShardContext, Sharded
from plait.core.strategy import Strategies
from plait.plugins.ddp.buckets import BucketedAllReduce

NAME = "ddp"


class DDPConfig(Section):
    """`[ddp]` section."""

    bucket_mb: float = Field(25.0, gt=0, description="gradient bucket size in MiB")
    first_bucket_mb: float = Field(
        1.0, gt=0, description="size cap of the first bucket, reduced earliest in backward"
    )
    rebuild_buckets: bool = Field(
        True, description="re-cut the buckets in the gradient order the first backward shows"
    )
    broadcast_parameters: bool = Field(
        True, description="copy dp rank 0's parameters to every replica at start"
    )


strategies = Strategies()


@strategies.provide(
    name=NAME,
    axis="dp",
    config_cls=DDPConfig,
    description="replicated parameters, overlapped bucketed gradient all-reduce",
)
def shard_ddp(model: nn.Module, *, context: ShardContext, config: DDPConfig) -> Sharded:
    group = context.mesh.gradient_group()  # dp, times cp under context parallelism
    experts = context.expert_parallel
    group_of = None
    if experts is not None:  # expert parameters: over the expert-data-parallel group only
        names = {id(p): normalised_name(n) for n, p in model.named_parameters()}
        group_of = lambda p: experts.gradient_group(names[id(p)], group)  # noqa: E731
    runtime = BucketedAllReduce(
        model,
        comm=context.comm,
        group=group,
        bucket_bytes=int(config.bucket_mb * 2**20),
        broadcast_parameters=config.broadcast_parameters,
        group_of=group_of,
        first_bucket_bytes=int(config.first_bucket_mb * 2**20),
        rebuild_buckets=config.rebuild_buckets,
    )
    return Sharded(module=model, runtime=runtime)


plait_register_strategies = strategies.plait_register_strategies
plait_shard = strategies.plait_shard
