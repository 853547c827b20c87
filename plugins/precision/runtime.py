"""The step side of mixed precision: fp32 master weights, loss scaling and the overflow skip.

Where each callback sits in a step, with data parallel applied after this transform (so its
runtime comes later in the engine's list):

1. `scale_loss` multiplies the (fp32) loss by the fp16 loss scale before every backward.
2. Backward writes low-precision gradients; data parallel reduces them in their dtype (or in
   `reduce_dtype`, through `ReduceDtypeCast`) during `sync_gradients`.
3. `skip_step` is the first callback after *every* runtime's `sync_gradients`, so it is where the
   final gradients are read: copied up into the fp32 masters' `.grad`, unscaled, and checked for
   inf/NaN across all ranks. An overflow skips the step on every rank.
4. `clip_gradients` takes the global norm over the fp32 master gradients (sharding marks are
   copied from the parameters, so TP/PP shards are counted once) and clips them.
5. The optimizer steps the masters; `after_optimizer_step` casts them back into the parameters.

Modules that add a loss of their own inside backward (the MoE balancing losses, injected by an
autograd function rather than added to the loss the engine differentiates) expose a float
`backward_loss_scale`; before every forward it is set to the loss scale, so their gradients are
scaled like the main loss's and come out right when the scaler divides them.

When another runtime builds the optimizer (ZeRO keeps its own shards; it can read the policy from
`context.precision`), no masters are kept here and loss scaling works on the module's
gradients directly.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from plait.core.comm import Comm, Group
from plait.core.grad_norm import SHARDED_AXES_ATTR, clip_grads_, global_grad_norm
from plait.core.memory import memory_report, storage_bytes
from plait.core.mesh import Mesh
from plait.core.schedule import MicrobatchPosition
from plait.core.sharding import OptimizerFactory, ParallelRuntime
from plait.core.state_layout import ParameterLayout, StateLayout, optimizer_state_layout
from plait.core.transforms import PrecisionPolicy
from plait.plugins.precision.scaler import DynamicLossScaler

# The attribute a module that injects a loss inside backward exposes (see the module docstring).
INJECTED_LOSS_SCALE_ATTR = "backward_loss_scale"


class MixedPrecisionRuntime(ParallelRuntime):
    """Master weights and loss scaling for one module under one `PrecisionPolicy`."""

    name = "amp"

    def __init__(
        self,
        module: nn.Module,
        *,
        policy: PrecisionPolicy,
        scaler: DynamicLossScaler | None,
        comm: Comm,
        mesh: Mesh,
        overflow_group: Group | None,
    ) -> None:
        self.module = module
        self.policy = policy
        self.scaler = scaler
        self.comm = comm
        self.mesh = mesh
        self.overflow_group = overflow_group
        # (module parameter, its fp32 master), filled when this runtime builds the optimizer.
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self.optimizer: torch.optim.Optimizer | None = None
        # Modules with a `backward_loss_scale` (found on the first forward).
        self._loss_injectors: list[nn.Module] | None = None

    # -- reported figures ------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps if self.scaler is not None else 0

    @property
    def owns_master_weights(self) -> bool:
        return bool(self.pairs)

    # -- ParallelRuntime -------------------------------------------------------------------------

    def build_optimizer(
        self, module: nn.Module, factory: OptimizerFactory
    ) -> torch.optim.Optimizer | None:
        if not self.policy.master_weights:
            return None
        masters = []
        for param in (p for p in module.parameters() if p.requires_grad):
            master = nn.Parameter(param.detach().to(torch.float32).clone())
            if hasattr(param, SHARDED_AXES_ATTR):
                setattr(master, SHARDED_AXES_ATTR, getattr(param, SHARDED_AXES_ATTR))
            self.pairs.append((param, master))
            masters.append(master)
        self.optimizer = factory(masters)
        return self.optimizer

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale_loss(loss) if self.scaler is not None else loss

    def before_forward(self, position: MicrobatchPosition) -> None:
        del position
        if self.scaler is None:
            return
        if self._loss_injectors is None:
            self._loss_injectors = [
                m
                for m in self.module.modules()
                if isinstance(getattr(m, INJECTED_LOSS_SCALE_ATTR, None), float)
            ]
        for module in self._loss_injectors:
            setattr(module, INJECTED_LOSS_SCALE_ATTR, float(self.scaler.scale))

    def skip_step(self) -> bool:
        grads = self._copy_grads_to_masters() if self.pairs else self._module_grads()
        if self.scaler is None:
            return False
        overflowed = self.scaler.unscale_and_check(grads, comm=self.comm, group=self.overflow_group)
        self.scaler.update(overflowed=overflowed)
        return overflowed

    def clip_gradients(self, max_norm: float) -> torch.Tensor | None:
        if not self.pairs:
            return None
        masters = [master for _, master in self.pairs]
        norm = global_grad_norm(masters, mesh=self.mesh, comm=self.comm)
        clip_grads_(masters, norm, max_norm)
        return norm

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        for param, master in self.pairs:
            param.copy_(master)

    def zero_grad(self) -> bool:
        # The engine's `optimizer.zero_grad` reaches only the masters. Zeroing in place keeps
        # any flat gradient buffer a data-parallel runtime installed as `.grad` views.
        for param, _ in self.pairs:
            if param.grad is not None:
                param.grad.zero_()
        # Later runtimes (data parallel) still zero what they own.
        return False

    def memory_report(self) -> dict[str, int] | None:
        if self.optimizer is None:
            return None
        report = memory_report(self.module, self.optimizer)
        del report["total"]
        masters = [master for _, master in self.pairs]
        report["master_weights"] = storage_bytes(masters)
        report["master_gradients"] = storage_bytes(master.grad for master in masters)
        report["total"] = sum(report.values())
        return report

    def state_layout(self, previous: StateLayout) -> StateLayout:
        """With master weights, the fp32 masters are the parameters' values — the low-precision
        parameters are their rounding — and the optimizer's state is the masters': checkpoints
        save and load those, and the parameters are cast down from the masters after a load.
        (Described as the module's parameters, a resumed job kept the masters it was built
        with, and its first step put the initial weights back.)"""
        if not self.pairs:
            return previous
        master_of = {id(param): master for param, master in self.pairs}
        optimizer = self.optimizer

        def refine(entry: ParameterLayout) -> ParameterLayout:
            master = master_of.get(id(entry.param))
            if master is None:
                return entry
            param = entry.param.detach()
            state = optimizer.state.get(master) if optimizer is not None else None
            tensors, step = optimizer_state_layout(state, master) if state else ({}, None)
            return replace(
                entry,
                value=entry.value.rebound(param, master.detach()),
                optimizer_state={key: entry.value.rebound(param, state[key]) for key in tensors},
                step=step,
            )

        return previous.map(refine).then(self._cast_masters_into_parameters)

    @torch.no_grad()
    def _cast_masters_into_parameters(self) -> None:
        for param, master in self.pairs:
            param.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"policy": self.policy.describe()}
        if self.scaler is not None:
            state["loss_scale"] = self.scaler.state_dict()
        if self.pairs:
            # The low-precision parameters cannot restore the fp32 masters' low bits.
            state["master_weights"] = [master.detach().clone() for _, master in self.pairs]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "loss_scale" in state:
            self.scaler.load_state_dict(state["loss_scale"])
        saved = state.get("master_weights")
        if saved is not None and self.pairs:
            if len(saved) != len(self.pairs):
                raise ValueError(
                    f"amp state holds {len(saved)} master weights, this model has {len(self.pairs)}"
                )
            for (param, master), value in zip(self.pairs, saved, strict=True):
                master.copy_(value)
                param.copy_(master)

    # -- gradients ------------------------------------------------------------------------------

    @torch.no_grad()
    def _copy_grads_to_masters(self) -> list[torch.Tensor]:
        grads = []
        for param, master in self.pairs:
            if param.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
            master.grad.copy_(param.grad)
            grads.append(master.grad)
        return grads

    def _module_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.module.parameters() if p.grad is not None]
