"""Vocab-parallel cross-entropy: the loss of vocab-split logits without ever gathering them.

Each tensor-parallel rank holds logits for a contiguous 1/tp of the vocabulary. The softmax
needs three numbers per token from the whole vocabulary — the max (for stability), the sum of
exponentials and the target's logit — and only those travel: one all-reduce of the per-token
max, one of (sum-exp, target logit) stacked. The gradient, `softmax − one_hot(target)`, is local
to each rank's slice. This is Megatron-LM's `_VocabParallelCrossEntropy` (Shoeybi et al. 2019,
section 3: "fuse the output embedding GEMM with the cross-entropy loss ... reducing the
communicated data from b·s·v to b·s").
"""

from __future__ import annotations

from typing import Any

import torch

from plait.plugins.tensor_parallel.tp_communications import TensorParallelGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        tp: TensorParallelGroup,
        ignore_index: int,
    ) -> torch.Tensor:
        vocab_local = logits.shape[-1]
        vocab_start = tp.rank * vocab_local
        flat = logits.reshape(-1, vocab_local).float()
        targets = targets.reshape(-1)

        # NOTE: the max only shifts the exponent; any value common to all ranks is exact.
        row_max = tp.all_reduce(flat.max(dim=-1).values, op="max")
        shifted = flat - row_max.unsqueeze(-1)
        exp = shifted.exp()

        local_target = targets - vocab_start
        outside = (local_target < 0) | (local_target >= vocab_local)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)

        summed = tp.all_reduce(torch.stack([exp.sum(dim=-1), target_logit]))
        sum_exp, target_logit = summed[0], summed[1]
        per_token = sum_exp.log() - target_logit

        valid = targets != ignore_index
        count = valid.sum().clamp(min=1)
        loss = per_token.masked_fill(~valid, 0.0).sum() / count

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, valid, count)
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, outside, valid, count = ctx.saved_tensors
        grad = softmax  # reused in place: backward runs once
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        scale = (valid.to(grad.dtype) * (grad_loss / count)).unsqueeze(-1)
        grad = (grad * scale).to(ctx.logits_dtype)
        return grad.reshape(ctx.logits_shape), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp: TensorParallelGroup,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean token cross-entropy of `logits[..., vocab/tp]` (this rank's contiguous vocab slice,
    rank r holding ids `[r·V/tp, (r+1)·V/tp)`) against full-vocabulary `targets[...]`.

    Identical on every tp rank; tokens equal to `ignore_index` are skipped. Computed in float32
    at least, like the reference `softmax_cross_entropy` kernel.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab-parallel cross-entropy: logits {tuple(logits.shape)} and targets "
            f"{tuple(targets.shape)} disagree on the token dims"
        )
    return _VocabParallelCrossEntropy.apply(logits, targets, tp, ignore_index)
