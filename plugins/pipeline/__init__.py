"""The pipeline plugin: the `pipeline` strategy for the pp axis and its schedules as action lists.

`schedules` builds the per-rank programs (GPipe, 1F1B, interleaved 1F1B, ZB-H1), `checker`
verifies any set of programs (matching, ordering, deadlock freedom), `timeline` simulates and
draws them. `split` cuts the model into cost-balanced chunks and `runtime` executes a rank's
program on its chunks over point-to-point messages through `plait.core.comm`.

Which models can be pipelined (`adapters`):

- plait's built-in models (`tok_embeddings`, `layers`, `norm`, `output`);
- `transformers` causal LMs of the Llama family (`LlamaForCausalLM`, `MistralForCausalLM`,
  `Qwen2ForCausalLM`) and `GPT2LMHeadModel`, passed to `plait.initialize` unwrapped with dict
  batches (`input_ids`, `labels`, optional `attention_mask` / `position_ids`): every stage
  recomputes positions, rotary tables and the causal mask with the model's own helpers, and the
  last stage returns the model's own output with its own (label-shifting) loss (`hf_stages`);
- any model whose forward is a plain chain of module calls, each taking the previous one's
  output alone (traced with `torch.fx`, nothing runs)::

      class Net(nn.Module):
          def forward(self, tokens):
              x = self.embed(tokens)
              for block in self.blocks:  # nn.ModuleList: the repeated blocks
                  x = block(x)
              return self.head(x)

  The modules called before the blocks go to the first stage, those after them to the last.
  The first stage receives the micro-batch's inputs (the `inputs` of an `(inputs, targets)`
  batch); between stages travel tensors `[micro_batch, seq, hidden]` (`seq` = dim 1 of the
  inputs, `hidden` from the first `nn.Embedding`, the model's config or `pipeline.hidden_size`);
  the last stage's output goes to the loss function (`loss_fn`, else token cross-entropy).

Stages begin where the cost balance puts them, at `pipeline.layers_per_stage` counts, or at the
blocks named in `pipeline.split_points`. A stage holds the model's own modules (not copies)
under their full names. Tied input/output embeddings on different ranks are supported with
data-parallel degree 1: their gradients are summed over the pipeline ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import torch
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
from plait.plugins.pipeline.adapters import adapter_for
from plait.plugins.pipeline.runtime import PipelineRuntime
from plait.plugins.pipeline.schedules import SCHEDULES, build_schedule
from plait.plugins.pipeline.split import (
    PipelineChunks,
    StagePlan,
    build_chunk,
    is_builtin_layout,
    layer_sizes_or_split,
    plan_blocks,
    plan_stages,
)
from plait.plugins.pipeline.tied import tied_parameters

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
    split_points: list[str] = Field(
        default_factory=list,
        description="full names of the blocks the stages after the first begin with, in model "
        "order (pp × virtual_stages - 1 names, e.g. ['model.layers.4'] or ['blocks.2']); "
        "empty = computed from the cost. For a model of one plain chain x = module(x) without "
        "repeated blocks, any module of the chain",
    )
    blocks: str = Field(
        "",
        description="dotted path of the container of repeated blocks of a model that is not "
        "built in or a supported transformers family (e.g. 'blocks'); its forward must be the "
        "chain embed → blocks (x = block(x)) → head. Empty = found from _no_split_modules or "
        "the longest ModuleList of one block class",
    )
    hidden_size: int = Field(
        0,
        ge=0,
        description="width of the hidden states sent between stages of such a chain model; "
        "0 = the first nn.Embedding's or the model config's",
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
    if not is_builtin_layout(model):
        return split_any_model(model, context=context, config=config)
    plan = plan_stages(
        model,
        num_stages=context.mesh.size("pp"),
        virtual_stages=schedule.virtual_stages,
        balance=config.balance,
        seq_len=context.config.data.seq_len,
        layers_per_stage=config.layers_per_stage,
        split_points=config.split_points,
    )
    if context.mesh.rank == 0:
        logger.info("%s", plan.describe())
    rank = context.mesh.coordinate("pp")
    mine = plan.for_rank(rank)
    chunks = [build_chunk(model, chunk) for chunk in mine]
    return _sharded(
        chunks, plan, context=context, config=config, hidden_dim=_hidden_dim(model), tied=()
    )


def _sharded(
    chunks: list[nn.Module],
    plan: StagePlan,
    *,
    context: ShardContext,
    config: PipelineConfig,
    hidden_dim: int,
    tied: Sequence[tuple[torch.Size, nn.Parameter | None]],
    source_model: nn.Module | None = None,
) -> Sharded:
    mine = plan.for_rank(context.mesh.coordinate("pp"))
    module: nn.Module = (
        chunks[0] if len(chunks) == 1 else PipelineChunks(chunks, [c.stage for c in mine])
    )
    context.pipeline = PipelineStages(
        num_stages=plan.num_stages,
        virtual_stages=plan.virtual_stages,
        summary=plan.describe(),
        source_model=source_model,
    )
    runtime = PipelineRuntime(
        chunks=chunks,
        plan=plan,
        context=context,
        hidden_dim=hidden_dim,
        measure_bubble=config.measure_bubble,
        tied=tied,
    )
    return Sharded(module=module, runtime=runtime)


def split_any_model(model: nn.Module, *, context: ShardContext, config: PipelineConfig) -> Sharded:
    """Stages of a model plait did not write, built from the model's own modules."""
    if context.mesh.size("tp") > 1:
        raise ConfigError(
            f"parallel.pp > 1 with parallel.tp > 1 is supported for plait's built-in models "
            f"only; {type(model).__name__} gets one or the other"
        )
    adapter = adapter_for(
        model,
        blocks_path=config.blocks,
        split_points=config.split_points,
        hidden_size=config.hidden_size,
    )
    embeddings, blocks, head = adapter.costs(config.balance)
    names = [name for name, _ in adapter.blocks]
    plan = plan_blocks(
        names,
        qualified=names,
        embeddings=embeddings,
        blocks=blocks,
        head=head,
        num_stages=context.mesh.size("pp"),
        virtual_stages=context.config.schedule.virtual_stages,
        balance=config.balance,
        layers_per_stage=layer_sizes_or_split(config.layers_per_stage, config.split_points),
    )
    if context.mesh.rank == 0:
        logger.info("%s (%s model)", plan.describe(), adapter.family)
    # Every rank builds every stage (they only reference the model's modules) to find the
    # parameters that stages on different ranks share.
    stages = {
        c.stage: adapter.stage(model, c.layers, first=c.has_embeddings, last=c.has_head)
        for c in plan.chunks
    }
    rank = context.mesh.coordinate("pp")
    tied = tied_parameters(model, plan, stages, rank=rank, context=context)
    chunks: list[nn.Module] = [stages[c.stage] for c in plan.for_rank(rank)]
    return _sharded(
        chunks,
        plan,
        context=context,
        config=config,
        hidden_dim=adapter.hidden_size,
        tied=tied,
        source_model=model,
    )


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
