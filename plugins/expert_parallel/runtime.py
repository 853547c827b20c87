"""The expert-parallel runtime: balancing-loss scale, routing-bias updates, expert state layout.

What it does each step, for every MoE layer of the model:

- before each forward, sets the layer's balancing-loss scale to 1 / micro-batches, the factor
  the engine applies to each micro-batch's loss, so the auxiliary loss weighs the same however
  the batch is split;
- after the optimizer step, sums the layers' per-expert loads over the data-parallel ranks
  (one all-reduce for all layers) and hands them to `update_expert_bias` (DeepSeek-V3's
  auxiliary-loss-free balancing: every rank applies the same update), then keeps the step's
  loads for reports and clears the counters.

Checkpoints: the layers' routing state (`routing_buffers()`, the loss-free balancing bias) is
declared as whole tensors beside the parameters, so a resumed run routes as the saved one did.
Expert tensors are declared as rows `[first_expert, first_expert + L)` of the
global stacked tensor (num_experts along dim 0), not replicated over dp (the expert-data-parallel
replicas hold identical rows, which the checkpoint writer stores once), so a checkpoint saved
at one ep degree loads at any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import nn

from plait.core.comm import Comm, Group, world_group
from plait.core.comm_algorithms import GRAD_NORM, METRICS
from plait.core.grad_norm import clip_grads_, sharded_axes
from plait.core.mesh import Mesh
from plait.core.names import normalised_name
from plait.core.schedule import MicrobatchPosition
from plait.core.sharding import ParallelRuntime
from plait.core.state_layout import ParameterLayout, StateLayout, TensorLayout
from plait.core.transforms import ExpertParallelism
from plait.plugins.expert_parallel.expert_load import publish_expert_load


class MoELayerLike(Protocol):
    """What the ep transform needs of a MoE layer (plait's `moe` model has it; so can yours):
    `experts`, a module whose parameters stack the experts along dim 0 and whose
    `first_expert` is the global index of row 0; `run_experts(x, counts)` (replaceable);
    `tokens_per_expert`, a buffer of assignments counted since the last clear;
    `balance_loss_scale`; `update_expert_bias(load)`. Optionally `routing_buffers()`: state
    of the routing that no optimizer holds (the loss-free balancing bias), by name under the
    layer, which checkpoints then save and restore."""

    experts: nn.Module
    tokens_per_expert: torch.Tensor
    balance_loss_scale: float

    def run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...

    def update_expert_bias(self, load: torch.Tensor) -> None: ...


_MOE_LAYER_MEMBERS = (
    "experts", "tokens_per_expert", "balance_loss_scale", "run_experts", "update_expert_bias",
)  # fmt: skip


def is_moe_layer(module: nn.Module) -> bool:
    """Whether `module` has what `MoELayerLike` names. Checked with `hasattr`, not `isinstance`
    against a runtime-checkable protocol: from Python 3.12 that looks members up with
    `inspect.getattr_static`, which cannot see an `nn.Module`'s submodules and buffers (they
    live in `_modules` / `_buffers`, reached through `__getattr__`), so no layer would match."""
    return all(hasattr(module, member) for member in _MOE_LAYER_MEMBERS) and hasattr(
        module.experts, "first_expert"
    )


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayerLike]]:
    return [
        (name, module)  # type: ignore[misc]
        for name, module in model.named_modules()
        if is_moe_layer(module)
    ]


class ExpertParallelRuntime(ParallelRuntime):
    name = "ep"

    def __init__(
        self,
        layers: Sequence[MoELayerLike],
        *,
        module: nn.Module,
        comm: Comm,
        mesh: Mesh,
        load_group: Group,
        layout: ExpertParallelism,
        names: Sequence[str] | None = None,
    ) -> None:
        self.layers = list(layers)
        # What reports call the layers; found from the module by identity when not given.
        self._names = list(names) if names is not None else None
        self.module, self.mesh = module, mesh
        self.comm, self.load_group, self.layout = comm, load_group, layout
        # Per-expert assignments of the last step, all data-parallel ranks: (layers, experts).
        self.last_load: torch.Tensor | None = None

    def before_forward(self, position: MicrobatchPosition) -> None:
        for layer in self.layers:
            layer.balance_loss_scale = 1.0 / position.num_microbatches

    def after_optimizer_step(self) -> None:
        if not self.layers:
            return
        loads = torch.stack([layer.tokens_per_expert for layer in self.layers]).float()
        # Dropped assignments ride along as one more column (layers that do not count them: 0).
        dropped = torch.stack(
            [getattr(layer, "dropped_tokens", loads.new_zeros(())) for layer in self.layers]
        ).to(loads)
        counts = torch.cat([loads, dropped.unsqueeze(1)], dim=1)
        if self.load_group.size > 1:
            self.comm.all_reduce(counts, group=self.load_group, op="sum", purpose=METRICS)
        loads, dropped = counts[:, :-1], counts[:, -1]
        for layer, load in zip(self.layers, loads, strict=True):
            layer.update_expert_bias(load)
            layer.tokens_per_expert.zero_()
            if isinstance(getattr(layer, "dropped_tokens", None), torch.Tensor):
                layer.dropped_tokens.zero_()
        self.last_load = loads
        publish_expert_load(self._layer_names(), loads, dropped)

    def _layer_names(self) -> list[str]:
        """Module names of the MoE layers (what reports call them), found once."""
        if self._names is None:
            by_id = {id(m): normalised_name(n) for n, m in self.module.named_modules()}
            self._names = [by_id.get(id(layer), f"moe{i}") for i, layer in enumerate(self.layers)]
        return self._names

    def clip_gradients(self, max_norm: float) -> torch.Tensor | None:
        """The global norm when experts are sharded: an expert slice is held by world / ep
        ranks (times any other axis the parameter is sharded over), so each rank adds
        `‖g‖² · shards / world` and one all-reduce counts every distinct tensor once (as
        `plait.core.grad_norm` does for mesh axes; ep is carved out of dp, not one of them)."""
        if self.layout.degree == 1:
            return None  # replicated experts: the core (or ZeRO) computes the norm
        named = [
            (normalised_name(n), p)
            for n, p in self.module.named_parameters()
            if p.requires_grad and p.grad is not None
        ]
        if not named:
            # The data-parallel strategy holds the gradients (ZeRO-2/3 shards): it computes the
            # norm from its shards, over its expert-dp and dp groups.
            return None
        total = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        for name, p in named:
            shards = self.layout.degree if self.layout.is_expert(name) else 1
            for axis in sharded_axes(p):
                shards *= self.mesh.size(axis)
            total += p.grad.detach().float().pow(2).sum() * (shards / self.mesh.world_size)
        if self.mesh.world_size > 1:
            self.comm.all_reduce(total, group=world_group(), op="sum", purpose=GRAD_NORM)
        norm = total.sqrt()
        clip_grads_([p for _, p in named], norm, max_norm)
        return norm

    def state_layout(self, previous: StateLayout) -> StateLayout:
        previous = self._with_routing_state(previous)
        layout = self.layout
        if layout.degree == 1:
            return previous

        def place(tensor: TensorLayout) -> TensorLayout:
            shape = (layout.num_experts, *tensor.global_shape[1:])
            offsets = (layout.first_expert, *[0] * (len(shape) - 1))
            return tensor.sharded_along("dp", global_shape=shape, offsets=offsets)

        def refine(entry: ParameterLayout) -> ParameterLayout:
            return entry.map_tensors(place) if layout.is_expert(entry.name) else entry

        return previous.map(refine)

    def _with_routing_state(self, previous: StateLayout) -> StateLayout:
        """`previous` plus each layer's routing state (`routing_buffers()`: the loss-free
        balancing bias), so checkpoints save and restore it like a parameter: whole on every
        rank, replicated like the layer's router (over dp and tp, not over pipeline stages),
        named after the layer's parameters (a pipeline stage's renamed ones included)."""
        by_param = {id(entry.param): entry for entry in previous.parameters}
        extra: list[ParameterLayout] = []
        for layer in self.layers:
            buffers = layer.routing_buffers() if hasattr(layer, "routing_buffers") else {}
            if not buffers:
                continue
            local_name, anchor = next(
                (n, by_param[id(p)])
                for n, p in layer.named_parameters()  # type: ignore[attr-defined]
                if id(p) in by_param and not n.startswith("experts.")
            )
            prefix = anchor.name[: len(anchor.name) - len(normalised_name(local_name))]
            replicated = anchor.value.replicated_over
            for name, buffer in buffers.items():
                extra.append(
                    ParameterLayout(
                        name=f"{prefix}{normalised_name(name)}",
                        param=buffer,
                        value=TensorLayout.whole(buffer, replicated_over=replicated),
                    )
                )
        return replace(previous, parameters=(*previous.parameters, *extra))

    def state_dict(self) -> dict[str, Any]:
        return {"ep": self.layout.degree}
