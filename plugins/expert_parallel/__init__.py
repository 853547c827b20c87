"""The `ep` strategy: expert parallelism for mixture-of-experts layers (axis `ep`).

`parallel.ep = N` (N divides dp and every MoE layer's expert count) carves N-rank ep groups out
of dp, Megatron-Core's layout: dp rank d belongs to ep group d // N at position d % N, and holds
experts `[(d % N)·E/N, (d % N + 1)·E/N)` of every MoE layer; the dp / N ranks that hold the
same experts form the expert-data-parallel group. Tokens travel to their experts and back with
all-to-all (`plait.plugins.expert_parallel.dispatch`). Attention, norms, embeddings and routers
stay replicated over dp (tensor parallelism may split attention; experts stay whole per tp
rank).

Gradients: the strategy writes an `ExpertParallelism` on `context.expert_parallel`; data
parallelism (DDP) reduces expert parameters over the expert-dp group and everything else over
dp. An expert's gradient gathers the tokens of the N ranks of its ep group, each rank's loss
being its own mean, so the expert gradients are scaled by 1/N as they are produced (a hook),
which makes the average over the expert-dp group the gradient of the global mean loss.

With `parallel.ep = 1` and `parallel.ep_strategy = "ep"` the experts stay replicated and
only the runtime runs (balancing-loss scale per micro-batch, routing-bias updates over dp).

A `transformers` MoE model (Mixtral, Qwen2-/Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V3, … : any
whose experts dispatch through transformers' `ExpertsInterface`) takes part through that
interface (`hf_experts`): its router, shared experts and losses stay its own, its expert
tensors keep their names and layout, and its load-balancing loss (`output_router_logits`)
covers every data-parallel rank's tokens as in one process (`hf_aux_loss`).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from plait.core.errors import ConfigError
from plait.core.names import normalised_name
from plait.core.sharding import ShardContext, Sharded
from plait.core.strategy import Strategies
from plait.core.transformers_models import is_transformers_model
from plait.core.transforms import ExpertParallelism
from plait.plugins.expert_parallel.dispatch import ExpertDispatch
from plait.plugins.expert_parallel.hf_aux_loss import WholeBatchLoadBalancingLoss
from plait.plugins.expert_parallel.hf_experts import (
    install_transformers_experts,
    transformers_moe_layers,
)
from plait.plugins.expert_parallel.runtime import ExpertParallelRuntime, moe_layers

NAME = "ep"

strategies = Strategies()


def _scale_gradient(grad: torch.Tensor, factor: float) -> torch.Tensor:
    return grad * factor


@strategies.provide(
    name=NAME,
    axis="ep",
    description="experts sharded over ep ranks carved out of dp, tokens moved by all-to-all",
)
def shard_ep(model: nn.Module, *, context: ShardContext, config: None) -> Sharded:
    del config
    degree = context.config.parallel.ep
    mesh = context.mesh
    transformers_model = is_transformers_model(model) and not moe_layers(model)
    if transformers_model:
        hf_layers = transformers_moe_layers(model, context.kernels)
        # Reported by the MoE block's name (the experts' parent), as the built-in layers are.
        layers = [(name.rpartition(".")[0], layer) for name, layer in hf_layers]
        experts_of = {id(layer): name for name, layer in hf_layers}
        runs_locally = {id(layer): layer.run_local_experts for _, layer in hf_layers}
    else:
        layers = moe_layers(model)
        experts_of = {id(layer): f"{name}.experts" for name, layer in layers}
        runs_locally = {id(layer): layer.experts for _, layer in layers}
    if not layers:
        raise ConfigError(
            f"parallel.ep_strategy = {NAME!r}: {type(model).__name__} has no MoE layer "
            "(a module with experts, run_experts and tokens_per_expert, or a transformers MoE "
            "model whose experts dispatch through its ExpertsInterface)"
        )
    ep_group, expert_data_group = mesh.expert_groups(degree)
    rank = ep_group.rank_of(mesh.rank)
    num_experts = {next(layer.experts.parameters()).shape[0] for _, layer in layers}
    if len(num_experts) != 1 or next(iter(num_experts)) % degree:
        raise ConfigError(
            f"parallel.ep = {degree} must divide every MoE layer's expert count; got "
            f"{sorted(num_experts)}"
        )
    total = num_experts.pop()
    local = total // degree
    expert_names: set[str] = set()
    for _, layer in layers:
        experts = layer.experts
        for leaf, param in list(experts.named_parameters(recurse=False)):
            expert_names.add(normalised_name(f"{experts_of[id(layer)]}.{leaf}"))
            if degree == 1:
                continue
            mine = nn.Parameter(param.detach()[rank * local : (rank + 1) * local].clone())
            setattr(experts, leaf, mine)
            mine.register_hook(partial(_scale_gradient, factor=1.0 / degree))
        if degree > 1:
            # Around the local experts: plait's grouped module, or the transformers layer's run.
            experts.first_expert = rank * local  # type: ignore[assignment]
            layer.run_experts = ExpertDispatch(  # type: ignore[method-assign]
                runs_locally[id(layer)],
                comm=context.comm,
                group=ep_group,
                rank=rank,
                num_experts=total,
            )
    if transformers_model:
        install_transformers_experts(model, hf_layers)
        loss = WholeBatchLoadBalancingLoss(model, comm=context.comm, group=mesh.gradient_group())
        model.register_forward_hook(loss, with_kwargs=True)
    layout = ExpertParallelism(
        degree=degree,
        rank=rank,
        num_experts=total,
        group=ep_group,
        expert_data_group=expert_data_group,
        expert_parameters=frozenset(expert_names),
    )
    context.expert_parallel = layout
    runtime = ExpertParallelRuntime(
        [layer for _, layer in layers],
        module=model,
        comm=context.comm,
        mesh=mesh,
        load_group=mesh.gradient_group(),
        layout=layout,
        names=[normalised_name(name) for name, _ in layers],
    )
    return Sharded(module=model, runtime=runtime)


plait_register_strategies = strategies.plait_register_strategies
plait_shard = strategies.plait_shard
