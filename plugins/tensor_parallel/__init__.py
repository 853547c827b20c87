"""The `megatron` tensor-parallel strategy (axis `tp`), with optional sequence parallelism.

Applied to the materialised full model: the planned linears and embeddings are replaced by
Megatron-style parallel layers holding this rank's slice (`plan.apply_plan`), attention is
split by heads, the MLP column → row, the token embedding and the output head by vocabulary,
and the runtime's loss is the vocab-parallel cross-entropy, which never gathers the logits.

`[tp]` section:

    [tp]
    sequence_parallel = true          # norms on sequence shards (Korthikanti et al. 2022)
    plan = { "blocks.*.fc1" = "colwise", "blocks.*.fc2" = "rowwise", "embed" = "vocab" }
    param_plan = {}                   # loose parameters split like a colwise bias
    output_module = "output"          # the vocab projection whose logits stay split
    loss_parallel = true              # false: all-gather the logits for any loss

Gradients: sharded parameters are marked for the global norm; replicated parameters whose
gradients are partial per rank — all of them under sequence parallelism (Megatron all-reduces
the layer-norm gradients the same way), and replicated grouped-query KV projections — are
summed over the tp group as soon as their gradient is final, before any data-parallel strategy
(registered later) reduces them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pydantic import Field
from torch import nn

from plait.core.config import Section
from plait.core.errors import ConfigError
from plait.core.schedule import MicrobatchPosition
from plait.core.sharding import ParallelRuntime, ShardContext, Sharded
from plait.core.state_layout import StateLayout
from plait.core.strategy import Strategies
from plait.core.transforms import TensorParallelism
from plait.plugins.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from plait.plugins.tensor_parallel.layers import (
    ColumnParallelLinear,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from plait.plugins.tensor_parallel.layout import tensor_parallel_layout
from plait.plugins.tensor_parallel.plan import TensorParallelLayout, apply_plan, resolve_plan
from plait.plugins.tensor_parallel.tp_communications import TensorParallelGroup

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelConfig",
    "TensorParallelRuntime",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
]

NAME = "megatron"
SECTION = "tp"


class TensorParallelConfig(Section):
    """`[tp]` section."""

    sequence_parallel: bool = Field(
        False, description="run norms on sequence shards; reduce-scatter / all-gather activations"
    )
    plan: dict[str, str] = Field(
        default_factory=dict,
        description="module-name pattern -> colwise/rowwise/vocab/positions/none, over the "
        "model's own tp_plan",
    )
    param_plan: dict[str, str] = Field(
        default_factory=dict, description="parameter-name pattern -> colwise, over tp_param_plan"
    )
    output_module: str = Field("output", description="the vocabulary projection (LM head)")
    loss_parallel: bool = Field(
        True, description="vocab-parallel cross-entropy on split logits (false: gather logits)"
    )


class TensorParallelRuntime(ParallelRuntime):
    """Step callbacks: the vocab-parallel loss and the tp sum of partial replicated gradients."""

    name = NAME

    def __init__(
        self,
        *,
        tp: TensorParallelGroup,
        layout: TensorParallelLayout,
    ) -> None:
        self.tp = tp
        self.layout = layout
        self._final_backward = True
        if tp.size > 1:
            for param in layout.tp_reduced_params:
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._sum_over_tp)

    def _sum_over_tp(self, param: torch.Tensor) -> None:
        # NOTE: synchronous, and in a hook registered before any data-parallel strategy's, so
        # a gradient is complete before DDP/ZeRO bucket it; on the last micro-batch only, when
        # the accumulated gradient holds every micro-batch's local part — or on every
        # micro-batch when a data-parallel runtime takes `.grad` away each time (ZeRO-2/3).
        if self._final_backward and param.grad is not None:
            self.tp.comm.all_reduce(param.grad, group=self.tp.group, op="sum", purpose="tp_grad")

    def loss_fn(self) -> Callable[..., torch.Tensor] | None:
        if not self.layout.vocab_parallel_output:
            return None
        tp = self.tp

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_cross_entropy(logits, targets, tp)

        return loss

    def before_backward(self, position: MicrobatchPosition) -> None:
        self._final_backward = position.gradients_final

    def sync_gradients(self) -> None:
        self._final_backward = True

    def state_layout(self, previous: StateLayout) -> StateLayout:
        return tensor_parallel_layout(previous, size=self.tp.size, rank=self.tp.rank)

    def state_dict(self) -> dict[str, Any]:
        return {"tp": self.tp.size, "styles": dict(self.layout.styles)}


strategies = Strategies()


@strategies.provide(
    name=NAME,
    axis="tp",
    config_cls=TensorParallelConfig,
    config_section=SECTION,
    description="Megatron tensor parallelism (column/row/vocab-parallel layers, "
    "vocab-parallel cross-entropy) with optional sequence parallelism",
)
def shard_tensor_parallel(
    model: nn.Module, *, context: ShardContext, config: TensorParallelConfig
) -> Sharded:
    mesh = context.mesh
    group = mesh.group("tp")
    tp = TensorParallelGroup(comm=context.comm, group=group, rank=mesh.coordinate("tp"))
    seq_len = context.config.data.seq_len
    if config.sequence_parallel and seq_len % tp.size:
        raise ConfigError(
            f"data.seq_len = {seq_len} is not divisible by parallel.tp = {tp.size}: sequence "
            "parallelism splits every sequence into tp equal shards"
        )
    layout = apply_plan(
        model,
        resolve_plan(model, config.plan),
        tp=tp,
        sequence_parallel=config.sequence_parallel,
        param_plan=resolve_plan(model, config.param_plan, attribute="tp_param_plan"),
        output_module=config.output_module,
        loss_parallel=config.loss_parallel,
    )
    context.tensor_parallel = TensorParallelism(
        degree=tp.size,
        sequence_parallel=config.sequence_parallel,
        vocab_parallel_output=layout.vocab_parallel_output,
        linear_splits=linear_splits(model, layout),
    )
    return Sharded(module=model, runtime=TensorParallelRuntime(tp=tp, layout=layout))


def linear_splits(model: nn.Module, layout: TensorParallelLayout) -> dict[str, str]:
    """How each parallel linear is split (`TensorParallelism.linear_splits`): "column" and
    "row" for plain `nn.Linear` shards, a description for the others."""
    splits = {}
    for name, style in layout.styles.items():
        module = model.get_submodule(name)
        if isinstance(module, ReplicatedHeadsLinear):
            splits[name] = "column with replicated key/value heads"
        elif isinstance(module, ColumnParallelLinear) and module.gather_output:
            splits[name] = "column, gathered output"
        elif isinstance(module, ColumnParallelLinear):
            splits[name] = "fused q | k | v column" if style == "colwise_qkv" else "column"
        elif isinstance(module, RowParallelLinear):
            splits[name] = "row"
        else:
            continue
        if getattr(module, "out_dim", 0) != 0:
            splits[name] = f"{splits[name]} of a Conv1D"
    return splits


plait_register_strategies = strategies.plait_register_strategies
plait_shard = strategies.plait_shard
