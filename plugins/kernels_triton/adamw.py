"""Triton fused AdamW: one kernel pass per tensor reads param, grad and both moments once.

The update is torch's `AdamW` (decoupled weight decay, bias-corrected moments, eps added to
the bias-corrected root of the second moment). Moments and the arithmetic are kept in fp32
whatever the parameter dtype, as torch's fused implementation does. Bias corrections are
computed on the host from the integer step, so the kernel takes only scalars.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

ADAMW_BLOCK = 1024


@triton.jit
def _adamw_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, n,
    lr, beta1, beta2, eps, weight_decay, step_size, inv_bias_correction2_sqrt,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    param = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    param = param * (1.0 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) * inv_bias_correction2_sqrt + eps
    param = param - step_size * exp_avg / denom
    tl.store(param_ptr + offs, param.to(param_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offs, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


def _check_lists(*lists: Sequence[torch.Tensor]) -> None:
    lengths = {len(tensors) for tensors in lists}
    if len(lengths) != 1:
        raise ValueError(f"adamw_step: params, grads and moments differ in length: {lengths}")
    for tensors in zip(*lists, strict=True):
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise ValueError(f"adamw_step: a parameter's tensors differ in shape: {shapes}")


@torch.no_grad()
def adamw_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int | float | torch.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """Apply one AdamW update in place; `step` counts from 1 (the update being applied)."""
    _check_lists(params, grads, exp_avgs, exp_avg_sqs)
    step = float(step.item() if isinstance(step, torch.Tensor) else step)
    if step < 1:
        raise ValueError(f"adamw_step: step counts from 1, got {step}")
    lr = float(lr)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    step_size = lr / bias_correction1
    inv_bias_correction2_sqrt = 1.0 / math.sqrt(bias_correction2)
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        n = param.numel()
        if n == 0:
            continue
        # A non-contiguous tensor is updated through a contiguous copy written back after.
        targets = [param, exp_avg, exp_avg_sq]
        work = [t if t.is_contiguous() else t.contiguous() for t in targets]
        _adamw_kernel[(triton.cdiv(n, ADAMW_BLOCK),)](
            work[0], grad.contiguous(), work[1], work[2], n,
            lr, beta1, beta2, eps, weight_decay, step_size, inv_bias_correction2_sqrt,
            BLOCK=ADAMW_BLOCK,
        )  # fmt: skip
        for original, updated in zip(targets, work, strict=True):
            if updated is not original:
                original.copy_(updated)
