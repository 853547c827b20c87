"""Triton fused softmax cross-entropy, chunked over the vocabulary.

One program per row walks the vocabulary in blocks with an online softmax (running max and
running sum of exponentials), so a row of any vocabulary size never has to fit in registers.
A second walk over the same row writes the gradient w.r.t. the logits *during the forward*,
into one buffer the size of the logits: the backward only scales it by the incoming gradient
(in place), so a full-vocabulary gradient is never materialised twice and no softmax is ever
stored. This is the scheme of Liger's fused cross-entropy, with the buffer kept separate from
the logits so callers may still read their logits afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

# A vocabulary block per iteration; large enough to keep loads wide on a GPU, small enough that
# a 128k-token vocabulary is walked in a few dozen steps.
DEFAULT_VOCAB_BLOCK = 4096


@triton.jit
def _cross_entropy_fwd(
    logits_ptr, targets_ptr, grad_ptr, losses_ptr, n_valid_ptr,
    stride_logits, stride_grad, vocab, ignore_index, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    grad_row = grad_ptr + row * stride_grad
    target = tl.load(targets_ptr + row)
    if target == ignore_index:
        for start in range(0, vocab, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            tl.store(grad_row + cols, 0.0, mask=cols < vocab)
        tl.store(losses_ptr + row, 0.0)
        return
    # Pass 1: online softmax statistics over vocabulary blocks.
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        block = tl.load(logits_row + cols, mask=cols < vocab, other=-float("inf"))
        block = block.to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(block, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(
            tl.exp(block - new_max), axis=0
        )
        running_max = new_max
    logsumexp = running_max + tl.log(running_sum)
    target_logit = tl.load(logits_row + target).to(tl.float32)
    tl.store(losses_ptr + row, logsumexp - target_logit)
    # Pass 2: d(mean loss)/d(logits) = (softmax - one_hot(target)) / n_valid.
    inv_n_valid = 1.0 / tl.load(n_valid_ptr)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab
        block = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(block - logsumexp) - tl.where(cols == target, 1.0, 0.0)
        tl.store(grad_row + cols, (grad * inv_n_valid).to(grad_ptr.dtype.element_ty), mask=mask)


def cross_entropy_forward(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, vocab_block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, d(loss)/d(logits)): the gradient is written by the forward (module doc)."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"softmax_cross_entropy: logits must be (N, V) and targets (N,); got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    n_rows, vocab = logits.shape
    # Counted on the device and read by the kernel: no host synchronisation per step.
    n_valid = (targets != ignore_index).sum().to(torch.float32)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if n_rows:
        _cross_entropy_fwd[(n_rows,)](
            logits, targets, grad, losses, n_valid.clamp_min(1.0),
            logits.stride(0), grad.stride(0), vocab, ignore_index,
            BLOCK_V=min(vocab_block, triton.next_power_of_2(vocab)),
        )  # fmt: skip
    # In fp32 whatever the logits' dtype; 0 / 0 = nan when every target is ignored, as
    # torch's mean reduction gives.
    return losses.sum() / n_valid, grad


class SoftmaxCrossEntropyFunction(torch.autograd.Function):
    """Mean cross-entropy of logits (N, V) against targets (N,), skipping `ignore_index`."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        vocab_block: int,
    ) -> torch.Tensor:
        loss, grad = cross_entropy_forward(logits, targets, ignore_index, vocab_block)
        ctx.save_for_backward(grad)
        ctx.grad_consumed = False
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        if ctx.grad_consumed:
            raise RuntimeError(
                "softmax_cross_entropy (triton) scales its precomputed gradient in place and "
                "cannot run backward twice through one graph (retain_graph=True)"
            )
        ctx.grad_consumed = True
        # The forward already wrote d(loss)/d(logits); scale the one buffer in place.
        grad.mul_(dloss.to(grad.dtype))
        return grad, None, None, None


def softmax_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    *,
    vocab_block: int = DEFAULT_VOCAB_BLOCK,
) -> torch.Tensor:
    """Mean cross-entropy over rows whose target is not `ignore_index`.

    `vocab_block` is the vocabulary chunk one loop iteration handles (a power of two).
    """
    if vocab_block <= 0 or vocab_block & (vocab_block - 1):
        raise ValueError(f"vocab_block must be a power of two, got {vocab_block}")
    return SoftmaxCrossEntropyFunction.apply(logits, targets, ignore_index, vocab_block)
