"""Triton fused softmax cross-entropy, chunked over the vocabulary.

The forward walks each row once: one program per row, vocabulary blocks in turn, an online
softmax (running max, running sum of exponentials) so that a row of any vocabulary size never
has to fit in registers. It keeps the row's log-sum-exp (fp32, one number per row), never a
softmax. The backward walks the row once more and writes `(softmax − one_hot(target)) · scale`
straight from the logits and that log-sum-exp, with `scale = d(loss) / n_valid` read on the
device. The warps per row are tuned per GPU model at the first launch (`tuning.py`); both
kernels write their outputs whole, so timing them has no side effect.

That is the least traffic a softmax cross-entropy can move: the logits read twice, their
gradient written once — what `torch.compile` of the reference moves too. Writing the gradient
during the forward (Liger's scheme) saves the second read only by writing into the logits in
place; kept beside them, as callers may still read their logits, it costs a logits-sized buffer
from forward to backward and one more read and write to scale it by the incoming gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from plait.plugins.kernels_triton.tuning import Tile, TileTuner, power_of_two_class, tile

# A vocabulary block per iteration; large enough to keep loads wide on a GPU, small enough that
# a 128k-token vocabulary is walked in a few dozen steps.
DEFAULT_VOCAB_BLOCK = 4096

# Triton's launch defaults (4 warps, 3 stages) and more warps per row: a row is walked block
# by block, each block reduced across the program's warps.
_WARPS_TILES = [tile(warps, 3) for warps in (4, 8, 16)]
FORWARD_TILES = TileTuner("softmax_cross_entropy.forward", _WARPS_TILES, default=_WARPS_TILES[0])
BACKWARD_TILES = TileTuner("softmax_cross_entropy.backward", _WARPS_TILES, default=_WARPS_TILES[0])


@triton.jit
def _cross_entropy_fwd(
    logits_ptr, targets_ptr, losses_ptr, lse_ptr, stride_logits, vocab, ignore_index,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    target = tl.load(targets_ptr + row)
    if target == ignore_index:
        tl.store(losses_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        return
    # Online softmax statistics over vocabulary blocks.
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
    tl.store(lse_ptr + row, logsumexp)


@triton.jit
def _cross_entropy_bwd(
    logits_ptr, targets_ptr, lse_ptr, scale_ptr, grad_ptr, stride_logits, stride_grad, vocab,
    ignore_index, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_logits
    grad_row = grad_ptr + row * stride_grad
    target = tl.load(targets_ptr + row)
    if target == ignore_index:
        for start in range(0, vocab, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            tl.store(grad_row + cols, 0.0, mask=cols < vocab)
        return
    logsumexp = tl.load(lse_ptr + row)
    # d(loss)/d(logits) = (softmax - one_hot(target)) · d(loss) / n_valid.
    scale = tl.load(scale_ptr)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab
        block = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(block - logsumexp) - tl.where(cols == target, 1.0, 0.0)
        tl.store(grad_row + cols, (grad * scale).to(grad_ptr.dtype.element_ty), mask=mask)


def _check_shapes(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"softmax_cross_entropy: logits must be (N, V) and targets (N,); got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )


def _vocab_block(vocab: int, vocab_block: int) -> int:
    return min(vocab_block, triton.next_power_of_2(vocab))


def _problem(logits: torch.Tensor, block: int) -> tuple[str, int, int, int]:
    n_rows, vocab = logits.shape
    dtype = str(logits.dtype).removeprefix("torch.")
    return dtype, block, power_of_two_class(vocab), power_of_two_class(n_rows)


def cross_entropy_forward(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, vocab_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, per-row log-sum-exp, number of scored rows): the last two, both fp32 on the
    device, are what `cross_entropy_backward` needs beside the logits and targets."""
    _check_shapes(logits, targets)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    n_rows, vocab = logits.shape
    # Counted on the device and read by the backward: no host synchronisation per step.
    n_valid = (targets != ignore_index).sum().to(torch.float32)
    losses = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    block = _vocab_block(vocab, vocab_block)

    def launch(chosen: Tile) -> None:
        _cross_entropy_fwd[(n_rows,)](
            logits, targets, losses, lse, logits.stride(0), vocab, ignore_index,
            BLOCK_V=block, **chosen.launch_options(),
        )  # fmt: skip

    if n_rows:
        launch(FORWARD_TILES.choose(_problem(logits, block), launch, logits.device))
    # In fp32 whatever the logits' dtype; 0 / 0 = nan when every target is ignored, as
    # torch's mean reduction gives.
    return losses.sum() / n_valid, lse, n_valid


def cross_entropy_backward(
    dloss: torch.Tensor,
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    n_valid: torch.Tensor,
    ignore_index: int,
    vocab_block: int,
) -> torch.Tensor:
    """d(loss)/d(logits) of `cross_entropy_forward`, for an incoming gradient `dloss`."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    targets = targets.contiguous()
    n_rows, vocab = logits.shape
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    # Rows with no scored target get zeros whatever the scale; clamping keeps it finite.
    scale = (dloss.to(torch.float32) / n_valid.clamp_min(1.0)).reshape(1)
    block = _vocab_block(vocab, vocab_block)

    def launch(chosen: Tile) -> None:
        _cross_entropy_bwd[(n_rows,)](
            logits, targets, lse, scale, grad, logits.stride(0), grad.stride(0), vocab,
            ignore_index, BLOCK_V=block, **chosen.launch_options(),
        )  # fmt: skip

    if n_rows:
        launch(BACKWARD_TILES.choose(_problem(logits, block), launch, logits.device))
    return grad


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
        loss, lse, n_valid = cross_entropy_forward(logits, targets, ignore_index, vocab_block)
        ctx.save_for_backward(logits, targets, lse, n_valid)
        ctx.ignore_index, ctx.vocab_block = ignore_index, vocab_block
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = cross_entropy_backward(dloss, *ctx.saved_tensors, ctx.ignore_index, ctx.vocab_block)
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
