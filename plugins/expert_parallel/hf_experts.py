"""Expert parallelism for `transformers` MoE models, through their experts interface.

transformers 5 stores a MoE layer's routed experts fused (`gate_up_proj` (E, 2·I, H) and
`down_proj` (E, H, I), stacked along dim 0; some families transposed, with biases, or with a
gate of their own) in a module decorated with `@use_experts_implementation`, whose forward
`(hidden_states, top_k_index, top_k_weights)` dispatches to
`ExpertsInterface[config._experts_implementation]`. Mixtral, Qwen2-MoE (with its shared
expert), Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V3 and the other families built that way take
part unchanged: the router, the top-k, `norm_topk_prob`, shared experts and the auxiliary loss
stay the model's own code, and this module registers the experts' computation under a name of
its own (`plait_ep_<n>`) and selects it with `model.set_experts_implementation`, so no model
code is patched.

The registered function sorts the (token, slot) assignments by expert, hands them to the
layer's `run_experts(x, counts)` — the local experts, run with the kernel facade's
`grouped_mm`, or under expert parallelism plait's all-to-all `ExpertDispatch` around them —
and combines the outputs with the routing weights in HF's own order (per token, slot 0 first).
`TransformersExpertsLayer` is what the expert-parallel runtime sees of one such layer
(`MoELayerLike`): assignments per expert are counted for the load reports; transformers' MoE
has no loss-free routing bias to update.

Parameters keep their names and layout (an ep rank holds rows `[first, first + E/ep)` of each
stacked tensor), so checkpoints and `export_hf_from` see the model's own tensors.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plait.core.errors import ConfigError
from plait.core.kernels import Kernels
from plait.core.names import normalised_name
from plait.core.transformers_models import model_kind, transformers_package

_names = itertools.count()


def uses_experts_interface(module: nn.Module) -> bool:
    """Whether `module` is a `transformers` experts module decorated with
    `@use_experts_implementation` (it carries the decorator's layout flags)."""
    flags = ("has_gate", "has_bias", "is_transposed", "_is_expert_parallel")
    return all(hasattr(module, flag) for flag in flags) and isinstance(
        getattr(module, "down_proj", None), torch.Tensor
    )


class TransformersExpertsLayer:
    """One `transformers` experts module as the expert-parallel runtime sees a MoE layer."""

    def __init__(self, experts: nn.Module, *, kernels: Kernels, num_experts: int) -> None:
        self.experts = experts
        self.kernels = kernels
        self.num_experts = num_experts
        device = experts.down_proj.device
        # Assignments per expert routed from this rank's tokens since the last report.
        self.tokens_per_expert = torch.zeros(num_experts, device=device)
        self.balance_loss_scale = 1.0  # set by the runtime; the model's own aux loss is used
        # Replaced by `ExpertDispatch` (around `run_local_experts`) under expert parallelism.
        self.run_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            self.run_local_experts
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        order = expert.argsort(stable=True)  # assignment order within an expert: token order
        counts = torch.bincount(expert, minlength=self.num_experts)
        with torch.no_grad():
            self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        routed = self.run_experts(hidden_states.index_select(0, order // top_k), counts)
        # Back to assignment order (token-major, slot-minor), weighted and summed per token.
        by_assignment = torch.empty_like(routed).index_copy(0, order, routed)
        weights = top_k_weights.unsqueeze(-1).to(routed.dtype)
        combined = (by_assignment.view(tokens, top_k, -1) * weights).sum(dim=1)
        return combined.to(hidden_states.dtype)

    def run_local_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of `x` grouped by this rank's experts (`counts` each) → the experts' outputs."""
        experts = self.experts
        grouped_mm = self.kernels.get("grouped_mm", x.device, x.dtype)
        up = experts.gate_up_proj if experts.has_gate else experts.up_proj
        hidden = grouped_mm(x, _out_in(up, experts.is_transposed), counts)
        if experts.has_bias:
            bias = experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias
            hidden = hidden + bias.repeat_interleave(counts, dim=0)
        hidden = experts._apply_gate(hidden) if experts.has_gate else experts.act_fn(hidden)
        out = grouped_mm(hidden, _out_in(experts.down_proj, experts.is_transposed), counts)
        if experts.has_bias:
            out = out + experts.down_proj_bias.repeat_interleave(counts, dim=0)
        if getattr(experts, "has_post_expert_norm", False):
            out = experts.post_expert_norm(out)
        return out

    def update_expert_bias(self, load: torch.Tensor) -> None:
        """transformers' MoE routers have no loss-free balancing bias: nothing to update."""
        del load


def _out_in(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A stacked expert weight in `grouped_mm`'s (experts, out, in) convention."""
    return weight.transpose(-2, -1) if transposed else weight


class PlaitExperts:
    """The function registered in transformers' `ExpertsInterface`: each experts module's
    computation, by the layer plait made of it."""

    def __init__(self) -> None:
        self.layers: dict[int, TransformersExpertsLayer] = {}

    # Eager under `torch.compile`, the whole experts call: its dispatch is (the token counts
    # of the step), and traced, the lookup by `id(module)` would be guarded on per layer.
    @torch.compiler.disable
    def __call__(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        return self.layers[id(module)].forward(hidden_states, top_k_index, top_k_weights)


def transformers_moe_layers(
    model: nn.Module, kernels: Kernels
) -> list[tuple[str, TransformersExpertsLayer]]:
    """(experts module name, layer) for every routed-experts module of a `transformers` MoE
    model; a model whose MoE layers do not dispatch through `ExpertsInterface` is refused."""
    found = [(n, m) for n, m in model.named_modules() if uses_experts_interface(m)]
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if not found or not callable(can_set) or not can_set():
        raise ConfigError(
            f"expert parallelism runs a transformers MoE model's experts through its "
            f"ExpertsInterface (experts_implementation, transformers 5: experts fused into "
            f"gate_up_proj / down_proj under @use_experts_implementation); {model_kind(model)} "
            "has no such experts module"
        )
    layers = []
    for name, module in found:
        count = int(module.down_proj.shape[0])
        layers.append(
            (
                normalised_name(name),
                TransformersExpertsLayer(module, kernels=kernels, num_experts=count),
            )
        )
    return layers


def install_transformers_experts(
    model: nn.Module, layers: list[tuple[str, TransformersExpertsLayer]]
) -> None:
    """Register the layers' computation as `model`'s experts implementation and select it."""
    transformers = transformers_package()
    assert transformers is not None
    from transformers.integrations.moe import ExpertsInterface

    function = PlaitExperts()
    for _, layer in layers:
        function.layers[id(layer.experts)] = layer
    name = f"plait_ep_{next(_names)}"
    ExpertsInterface.register(name, function)
    weakref.finalize(model, _unregister, ExpertsInterface, name)
    model.set_experts_implementation(name)  # type: ignore[operator]
    chosen = getattr(model.config, "_experts_implementation", None)
    if chosen != name:
        raise ConfigError(
            f"expert parallelism: {model_kind(model)} kept experts implementation {chosen!r} "
            f"when asked for {name!r}"
        )


def _unregister(interface: Any, name: str) -> None:
    interface._global_mapping.pop(name, None)
