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
    """How each micro-batch's mean loss enters one step's gradient and reported loss.

    Counts stay tensors on the compute device: weighing a step costs one all-reduce and no
    host synchronisation before the forward."""

    scored: torch.Tensor  # (micro-batches,) float64: this rank's scored tokens of each
    global_scored: torch.Tensor  # 0-d float64 (exact to 2⁵³), N: scored tokens of the global batch
    replicas: int  # R: ranks whose gradients are averaged (dp × cp)

    def weigh(self, microbatch: int, loss: torch.Tensor) -> torch.Tensor:
        """Micro-batch `microbatch`'s mean loss weighted for backward: loss · c_m · R / N. A
        micro-batch that scores no token (its mean is 0 / 0) trains on nothing."""
        count = self.scored[microbatch]
        scale = count * self.replicas / self.global_scored.clamp(min=1.0)
        # `where`, not nan_to_num: a loss that diverged on scored tokens must still show NaN.
        return torch.where(count > 0, loss, torch.zeros_like(loss)) * scale.to(loss.dtype)


def token_weights(
    counts: Sequence[torch.Tensor | None],
    *,
    all_reduce_sum: Callable[[torch.Tensor], None],
    replicas: int,
    device: torch.device,
) -> TokenWeights | None:
    """The step's weights from each micro-batch's count (`scored_tokens`), or `None` when this
    rank's losses cannot be weighed. `all_reduce_sum(tensor)` sums a tensor over the R ranks;
    every rank calls it, so that a rank that cannot weigh never leaves the others waiting (it
    adds no tokens; ranks of one job see batches of one kind)."""
    weighable = bool(counts) and all(count is not None for count in counts)
    scored = (
        torch.stack([count.to(device, torch.float64) for count in counts if count is not None])
        if weighable
        else torch.zeros(len(counts), device=device, dtype=torch.float64)
    )
    total = scored.sum().reshape(1)
    all_reduce_sum(total)
    if not weighable:
        return None
    return TokenWeights(scored=scored, global_scored=total[0], replicas=replicas)
