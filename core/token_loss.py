"""The step's loss is the token-weighted mean over the whole global batch: one definition, here.

Packed rows, padding and labels set to `ignore_index` leave ranks and micro-batches with
different numbers of scored tokens. The mean of every rank's mean (what averaging gradients over
data-parallel ranks computes by itself) then weighs a token on a sparse rank more than one on a
full rank. So, like Megatron-LM's `calculate_per_token_loss` and transformers'
`num_items_in_batch`, plait counts the scored tokens of the whole global batch `N` before any
backward (one scalar all-reduce over the ranks whose gradients are averaged, dp × cp) and
weighs micro-batch `m` of a rank by

    loss_m · c_m · R / N        c_m: its scored tokens, R: ranks averaging gradients

so that R's averaging and the sum over micro-batches give Σ (token losses) / N, the mean over
every scored token of the step. The reported loss is the same mean.

Which tokens count is a property of the loss, known before the step:

- `"targets"`: plait computes token cross-entropy against the batch's targets (its own models,
  a vocab-parallel loss, any model returning logits): every target ≠ `ignore_index`;
- `"shifted_labels"`: a transformers causal LM computes its own loss from `labels`, shifted
  inside the loss (or from the `shift_labels` a batch carries): labels[:, 1:] ≠ `ignore_index`;
- `None`: a loss plait cannot see inside (a `loss_fn` of the user's, a model's own loss of
  another kind, a batch that brings its own `num_items_in_batch`): the step's loss is then the
  mean of the micro-batch losses, each rank weighing the same, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

IGNORE_INDEX = -100

LossCounting = Literal["targets", "shifted_labels"] | None


def scored_tokens(inputs: Any, targets: Any, counting: LossCounting) -> torch.Tensor | None:
    """The number of tokens a micro-batch's loss is the mean over, as a 0-d int64 tensor, or
    `None` when its loss is not a token mean plait can weigh."""
    if counting is None:
        return None
    if counting == "shifted_labels":
        if not isinstance(inputs, Mapping) or "num_items_in_batch" in inputs:
            return None
        shifted = inputs.get("shift_labels")
        if isinstance(shifted, torch.Tensor):
            return (shifted != IGNORE_INDEX).sum()
        labels = inputs.get("labels")
        if not isinstance(labels, torch.Tensor):
            return None
        return (labels[..., 1:] != IGNORE_INDEX).sum()
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point():
        return None
    return (targets != IGNORE_INDEX).sum()


@dataclass(frozen=True, slots=True)
class TokenWeights:
    """How each micro-batch's mean loss enters one step's gradient and reported loss."""

    scored: tuple[float, ...]  # this rank's scored tokens per micro-batch
    global_scored: float  # N: scored tokens of the whole global batch
    replicas: int  # R: ranks whose gradients are averaged (dp × cp)

    def gradient_scale(self, microbatch: int) -> float:
        """The factor on micro-batch `microbatch`'s mean loss before backward: c_m · R / N.
        A step that scores no token at all trains on nothing (factor 0)."""
        if self.global_scored <= 0:
            return 0.0
        return self.scored[microbatch] * self.replicas / self.global_scored


def token_weights(
    counts: Sequence[torch.Tensor | None],
    *,
    all_reduce_sum: Callable[[torch.Tensor], None],
    replicas: int,
) -> TokenWeights | None:
    """The step's weights from each micro-batch's count (`scored_tokens`), or `None` when the
    loss of any micro-batch on any of the R ranks cannot be weighed (every rank then falls back
    together). `all_reduce_sum(tensor)` sums a float64 tensor over the R ranks."""
    unweighable = any(count is None for count in counts)
    local = [float(count) for count in counts if count is not None]
    totals = torch.tensor([sum(local), float(unweighable)], dtype=torch.float64)
    all_reduce_sum(totals)
    if unweighable or totals[1].item() > 0:
        return None
    return TokenWeights(scored=tuple(local), global_scored=totals[0].item(), replicas=replicas)
