"""The pipeline plugin: the `pipeline` strategy for the pp axis and its schedules as action lists.

`schedules` builds the per-rank programs (GPipe, 1F1B, interleaved 1F1B, ZB-H1), `checker`
verifies any set of programs (matching, ordering, deadlock freedom), `timeline` simulates and
draws them. `split` cuts the model into cost-balanced chunks and `runtime` executes a rank's
program on its chunks over point-to-point messages through `plait.core.comm`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from pydantic import Field
from torch import nn

from plait.core.config import Section
from plait.core.errors import ConfigError
from plait.core.hookspecs import hookimpl
from plait.core.records import ScheduleRecord
from plait.core.schedule import Action, ScheduleRequest
from plait.core.sharding import ShardContext, Sharded
from plait.core.strategy import Strategies
from plait.core.transforms import PipelineStages
from plait.plugins.pipeline.runtime import PipelineRuntime
from plait.plugins.pipeline.schedules import SCHEDULES, build_schedule
from plait.plugins.pipeline.split import PipelineChunks, build_chunk, plan_stages

NAME = "pipeline"
logger = logging.getLogger(__name__)


class PipelineConfig(Section):
    """`[pipeline]` section."""

    balance: Literal["flops", "params"] = Field(
        "flops", description="balance chunks by training FLOPs (time) or parameters (memory)"
    )
    layers_per_stage: list[int] = Field(
        default_factory=list,
        description="explicit blocks per chunk in global stage order (pp × virtual_stages "
        "counts); empty = computed from the per-layer cost",
    )
    measure_bubble: bool = Field(
        True, description="exchange per-stage busy time every step to report the bubble"
    )


@hookimpl
def plait_register_schedules() -> Sequence[ScheduleRecord]:
    return [
        ScheduleRecord(
            name=schedule.name,
            pipelined=True,
            supports_virtual_stages=schedule.supports_virtual_stages,
            description=schedule.description,
        )
        for schedule in SCHEDULES.values()
    ]


@hookimpl(trylast=True)
def plait_schedule(request: ScheduleRequest) -> list[Action] | None:
    if request.name not in SCHEDULES:
        return None
    return build_schedule(request)


strategies = Strategies()


@strategies.provide(
    name=NAME,
    axis="pp",
    config_cls=PipelineConfig,
    description="cost-balanced stage split with virtual chunks, P2P schedule runtime",
)
def split_pipeline(model: nn.Module, *, context: ShardContext, config: PipelineConfig) -> Sharded:
    schedule = context.config.schedule
    if not context.plugins.schedule_record(schedule.name).pipelined:
        pipelined = sorted(n for n, (_, r) in context.plugins.schedules().items() if r.pipelined)
        raise ConfigError(
            f"parallel.pp = {context.mesh.size('pp')} needs a pipelined schedule; schedule.name "
            f"is {schedule.name!r}; pipelined schedules: {', '.join(pipelined)}"
        )
    if schedule.virtual_stages > 1 and context.mesh.size("tp") > 1:
        # The tensor-parallel plan names the output head and the RoPE tables on the top-level
        # model; a rank holding several chunks has them one level down.
        raise ConfigError(
            "schedule.virtual_stages > 1 with parallel.tp > 1 is not supported yet: use one "
            "chunk per pipeline rank (e.g. schedule.name = '1f1b' or 'zb_h1') with tensor "
            "parallelism"
        )
    plan = plan_stages(
        model,
        num_stages=context.mesh.size("pp"),
        virtual_stages=schedule.virtual_stages,
        balance=config.balance,
        seq_len=context.config.data.seq_len,
        layers_per_stage=config.layers_per_stage,
    )
    if context.mesh.rank == 0:
        logger.info("%s", plan.describe())
    rank = context.mesh.coordinate("pp")
    mine = plan.for_rank(rank)
    chunks = [build_chunk(model, chunk) for chunk in mine]
    module: nn.Module = (
        chunks[0] if len(chunks) == 1 else PipelineChunks(chunks, [c.stage for c in mine])
    )
    context.pipeline = PipelineStages(
        num_stages=plan.num_stages, virtual_stages=plan.virtual_stages, summary=plan.describe()
    )
    runtime = PipelineRuntime(
        chunks=chunks,
        plan=plan,
        context=context,
        hidden_dim=_hidden_dim(model),
        measure_bubble=config.measure_bubble,
    )
    return Sharded(module=module, runtime=runtime)


def _hidden_dim(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    dim = getattr(config, "dim", None)
    if isinstance(dim, int):
        return dim
    embeddings = model.tok_embeddings
    assert isinstance(embeddings, nn.Embedding)
    return embeddings.embedding_dim


plait_register_strategies = strategies.plait_register_strategies
plait_shard = strategies.plait_shard
