"""Dynamic loss scaling for fp16: unscale, detect overflow on every rank, skip, back off, grow.

fp16 represents magnitudes down to ~6e-8 (subnormal), so small gradients vanish unless the loss
is multiplied by a large factor before backward. Too large a factor overflows instead; the
scaler then skips that optimizer step on every rank and halves the scale, and after
`growth_interval` clean steps in a row it doubles the scale again (Micikevicius et al., 2018;
the same rule as `torch.amp.GradScaler` and DeepSpeed's `DynamicLossScaler`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from plait.core.comm import Comm, Group
from plait.core.comm_algorithms import LOSS_SCALE


class DynamicLossScaler:
    """The scale and its bookkeeping; `unscale_and_check` decides identically on all ranks."""

    def __init__(
        self,
        *,
        initial_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = float(initial_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0  # consecutive steps without overflow since the last change
        self.skipped_steps = 0
        self.last_step_overflowed = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # fp32 whatever the loss's dtype: a scaled fp16 loss would overflow by itself.
        return loss.float() * self.scale

    def unscale_and_check(
        self, grads: Iterable[torch.Tensor], *, comm: Comm | None, group: Group | None
    ) -> bool:
        """Divide `grads` by the scale in place; return True if any rank found inf/NaN.

        One fused kernel per (device, dtype) does the division and the finiteness check, and one
        all-reduce (max) of the flag over `group` (the world: with tensor or pipeline parallelism
        each rank holds different gradients) makes every rank take the same decision.
        """
        by_kind: defaultdict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(
            list
        )
        for grad in grads:
            by_kind[(grad.device, grad.dtype)].append(grad)
        device = next(iter(by_kind))[0] if by_kind else torch.device("cpu")
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        inv_scale = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=device)
        for (grad_device, _), tensors in by_kind.items():
            flag = torch.zeros(1, dtype=torch.float32, device=grad_device)
            # The fused op `torch.amp.GradScaler` itself uses (CPU and CUDA kernels).
            torch._amp_foreach_non_finite_check_and_unscale_(
                tensors, flag, inv_scale.to(grad_device)
            )
            found_inf = torch.maximum(found_inf, flag.to(device))
        if comm is not None and group is not None and group.size > 1:
            comm.all_reduce(found_inf, group=group, op="max", purpose=LOSS_SCALE)
        return bool(found_inf.item() > 0)

    def update(self, *, overflowed: bool) -> None:
        """Back off after an overflow; grow after `growth_interval` clean steps in a row."""
        self.last_step_overflowed = overflowed
        if overflowed:
            self.skipped_steps += 1
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
