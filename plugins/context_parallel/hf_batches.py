"""A `transformers` causal LM's micro-batch, prepared whole before context parallelism cuts it.

A Hugging Face causal LM computes its own loss from `labels`, shifting them inside the loss
(`ForCausalLMLoss`: the logits at position p are scored against `labels[p + 1]`). Cut into
pieces, a rank would shift within its own piece and score its last position against the wrong
token (or none). So the labels are shifted here, over the whole sequence, and handed to the
model as `shift_labels`, which its loss takes as given: the label of a piece's last position
is the first token of the piece that follows it, on whichever rank holds that. The sequence's
last position has no next token (`ignore_index`), so the cp ranks score different numbers of
tokens: each rank's loss is its sum over `num_items_in_batch` = (the micro-batch's scored
tokens) / cp, which makes the mean of the cp ranks' losses (what averaging gradients over cp
computes) the loss of the whole sequence. A `num_items_in_batch` the batch already carries
(a gradient-accumulation window's count) is divided by cp the same way.

Position ids are the global positions (`0 … seq_len − 1`, cut with the rest), which rotary
(Llama, Mistral, Qwen2) and learned (GPT-2) position embeddings read.

Padding: right padding (every row's `attention_mask` ones then zeros) is exact under causal
attention, since no real token attends to a later one, provided no padded position is scored
(its label is `ignore_index`, as HF's collators make it); left padding, padding that scores
padded positions, 4-D masks and packed sequences (position ids that restart) are refused by
name. The mask itself travels with the batch (cut like the rest) for the model's own uses of
it, such as a MoE model's load-balancing loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from plait.core.errors import PlaitError

IGNORE_INDEX = -100


def prepare_causal_lm_batch(
    inputs: Any,
    targets: Any,
    seq_len: int,
    *,
    degree: int,
    model_name: str,
    loss_reads_shift_labels: bool,
) -> tuple[dict[str, Any], Any]:
    """`inputs` with `position_ids`, `shift_labels` and `num_items_in_batch` added (the whole
    micro-batch, before context parallelism cuts it), and the shifted labels as targets."""
    if not isinstance(inputs, Mapping) or not isinstance(inputs.get("input_ids"), torch.Tensor):
        raise PlaitError(
            f"context parallelism with {model_name} takes dict batches with `input_ids` (and "
            "`labels` for the model's own loss), as a Hugging Face data collator makes them"
        )
    batch = dict(inputs)
    tokens: torch.Tensor = batch["input_ids"]
    rows = tokens.shape[0]
    _check_positions(batch.get("position_ids"), seq_len, model_name)
    positions = torch.arange(seq_len, device=tokens.device)
    batch["position_ids"] = positions.unsqueeze(0).expand(rows, seq_len)
    shift = batch.get("shift_labels")
    labels = batch.get("labels")
    if shift is None and isinstance(labels, torch.Tensor):
        shift = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    _check_padding(batch.get("attention_mask"), shift, model_name)
    if shift is None:
        return batch, targets
    if not loss_reads_shift_labels:
        raise PlaitError(
            f"context parallelism shifts {model_name}'s labels over the whole sequence before "
            "cutting it and hands them to the loss as `shift_labels`, which transformers' "
            "ForCausalLMLoss reads; this model's loss_function is another one. Give "
            "plait.initialize a loss_fn (it receives the labels each position predicts), or "
            "train without parallel.cp"
        )
    batch["shift_labels"] = shift
    scored = batch.get("num_items_in_batch")
    if scored is None:
        scored = (shift != IGNORE_INDEX).sum()
    batch["num_items_in_batch"] = torch.as_tensor(scored, dtype=torch.float32) / degree
    return batch, shift


def _check_positions(given: Any, seq_len: int, model_name: str) -> None:
    if given is None:
        return
    expected = torch.arange(seq_len, device=given.device)
    if not isinstance(given, torch.Tensor) or not bool((given == expected).all()):
        raise PlaitError(
            f"context parallelism with {model_name}: the batch's position_ids are not 0 … "
            f"{seq_len - 1} on every row (packed sequences?); ring and Ulysses attention are "
            "causal over the whole row. Drop position_ids (they default to those), or train "
            "packed sequences without parallel.cp"
        )


def _check_padding(mask: Any, shift: torch.Tensor | None, model_name: str) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        raise PlaitError(
            f"context parallelism with {model_name}: attention_mask must be (batch, seq) of "
            "ones and zeros (padding); a 4-D or custom mask cannot be cut by position"
        )
    real = mask.bool()
    # Right padding: along each row, no real token after a padded one.
    if bool((real[:, 1:] & ~real[:, :-1]).any()):
        raise PlaitError(
            f"context parallelism with {model_name}: attention_mask pads on the left (or in "
            "the middle); a real token after padding would attend to it. Pad on the right "
            "(tokenizer.padding_side = 'right')"
        )
    if shift is not None and bool((shift[~real] != IGNORE_INDEX).any()):
        raise PlaitError(
            f"context parallelism with {model_name}: the batch scores padded positions (the "
            f"label after a padded token is not {IGNORE_INDEX}); set labels to {IGNORE_INDEX} "
            "on padding, as transformers' data collators do"
        )
