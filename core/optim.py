"""AdamW through the kernel facade, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from plait.core.config import OptimizerSection, TrainSection
from plait.core.kernels import Kernels


class AdamW(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam whose update is the `adamw_step` kernel.

    The update runs once per (device, dtype) group of parameters, so a fused kernel (Triton on
    CUDA) sees long tensor lists; the torch reference kernel is `torch._foreach_*` based.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        kernels: Kernels,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self.kernels = kernels

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            by_kind: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_kind.setdefault((p.device, p.dtype), []).append(p)
            for (device, dtype), params in by_kind.items():
                states = [self._state_for(p) for p in params]
                step = states[0]["step"] + 1
                for s in states:
                    s["step"] = step
                beta1, beta2 = group["betas"]
                self.kernels.get("adamw_step", device, dtype)(
                    params,
                    [p.grad for p in params],
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    step=step,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                )
        return loss

    def _state_for(self, p: nn.Parameter) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices; leave norms, biases and other 1-D parameters undecayed (GPT, Llama)."""
    decay, no_decay = [], []
    for p in params:
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def default_optimizer_factory(
    optimizer: OptimizerSection, kernels: Kernels
) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """The optimizer the config describes, as a factory over parameters."""

    def build(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return AdamW(
            param_groups(params, optimizer.weight_decay),
            kernels=kernels,
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
        )

    return build


def warmup_cosine(optimizer: OptimizerSection, train: TrainSection) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then cosine decay to `min_lr_ratio` at the last step."""
    warmup = optimizer.warmup_steps
    total = max(train.steps, warmup + 1)
    floor = optimizer.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
