"""A `transformers` causal LM's micro-batch, prepared whole before context parallelism cuts it.

A Hugging Face causal LM computes its own loss from `labels`, shifting them inside the loss
(`ForCausalLMLoss`: the logits at position p are scored against `labels[p + 1]`). Cut into
pieces, a rank would shift within its own piece and score its last position against the wrong
token (or none). So the labels are shifted here, over the whole sequence, and handed to the
model as `shift_labels`, which its loss takes as given: the label of a piece's last position
is the first token of the piece that follows it, on whichever rank holds that. The sequence's
last position has no next token (`ignore_index`). Each rank's loss is then the mean over its own
scored tokens, and the core weighs it by their count (`plait.core.token_loss`, which counts
`shift_labels`), so unequal counts across ranks still give the mean over every token. A
`num_items_in_batch` the batch carries itself (a gradient-accumulation window's count) makes the
batch user-normalised: the core leaves it unweighted, and it is divided by cp here, so the mean
of the cp ranks' sums over it is the whole sequence's.

Position ids: the batch's own (cut with the rest; rotary and learned position embeddings read
them), else the global positions `0 … seq_len − 1`.

Packed rows (position ids that restart at 0, as transformers' `DataCollatorWithFlattening`
makes them, or `cu_seq_lens_q` / `cu_seq_lens_k`): their `Documents` are computed here, on the
whole micro-batch, and travel in the batch under `DOCUMENTS_KEY`, a keyword argument the
model's forward hands down to its attention function (`hf_attention`), which masks with them.
Varlen offsets are taken out of the batch (the documents replace them) and, without position
ids, each document's positions restart at 0. Labels: plait scores what the batch's labels say.
`DataCollatorWithFlattening` sets the first label of every document to -100, so the shifted
label of a document's last token is -100 and no prediction crosses a boundary; a batch whose
labels do not has each document's last token scored against the next document's first token,
as the model's own loss over the whole row would (attention never crosses).

Padding: right padding (every row's `attention_mask` ones then zeros) is exact under causal
attention, since no real token attends to a later one, provided no padded position is scored
(its label is `ignore_index`, as HF's collators make it); left padding, padding that scores
padded positions and 4-D masks are refused by name. The mask itself travels with the batch (cut
like the rest) for the model's own uses of it, such as a MoE model's load-balancing loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from plait.core.documents import Documents
from plait.core.errors import PlaitError

IGNORE_INDEX = -100
# The batch entry (and so the keyword argument of the model's forward, handed on to its
# attention function) that carries a packed micro-batch's `Documents`.
DOCUMENTS_KEY = "plait_documents"
# Varlen metadata for flash-attention kernels: replaced by the documents.
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def prepare_causal_lm_batch(
    inputs: Any,
    targets: Any,
    seq_len: int,
    *,
    degree: int,
    model_name: str,
    loss_reads_shift_labels: bool,
    documents_reach_attention: bool = True,
) -> tuple[dict[str, Any], Any]:
    """`inputs` with `position_ids`, `shift_labels` and, for packed rows, their documents added
    (the whole micro-batch, before context parallelism cuts it), and the shifted labels as
    targets."""
    if not isinstance(inputs, Mapping) or not isinstance(inputs.get("input_ids"), torch.Tensor):
        raise PlaitError(
            f"context parallelism with {model_name} takes dict batches with `input_ids` (and "
            "`labels` for the model's own loss), as a Hugging Face data collator makes them"
        )
    batch = dict(inputs)
    tokens: torch.Tensor = batch["input_ids"]
    rows = tokens.shape[0]
    documents = _documents(batch, rows, seq_len, model_name)
    if documents is not None:
        if not documents_reach_attention:
            raise PlaitError(
                f"context parallelism with {model_name} in pipeline stages: the batch holds "
                "packed documents (position ids that restart, or cu_seq_lens), and the stages "
                "do not hand their document structure to attention, which would then cross "
                "documents. Train packed rows without parallel.pp, or send one document per row"
            )
        for key in VARLEN_KEYS:
            batch.pop(key, None)
        if batch.get("position_ids") is None:
            batch["position_ids"] = documents.positions
        batch[DOCUMENTS_KEY] = documents
    if batch.get("position_ids") is None:
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
    if scored is not None:
        batch["num_items_in_batch"] = torch.as_tensor(scored, dtype=torch.float32) / degree
    return batch, shift


def _documents(batch: dict[str, Any], rows: int, seq_len: int, model_name: str) -> Documents | None:
    """The micro-batch's documents when its rows are packed, else `None`; position ids given
    as (seq,) or (1, seq) are expanded to every row first (they are cut per row)."""
    positions = batch.get("position_ids")
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or positions.shape[-1] != seq_len:
            raise PlaitError(
                f"context parallelism with {model_name}: position_ids must be a tensor of "
                f"{seq_len} positions per row; got {getattr(positions, 'shape', positions)}"
            )
        positions = positions.reshape(-1, seq_len).expand(rows, seq_len)
        batch["position_ids"] = positions
        expected = torch.arange(seq_len, device=positions.device)
        if bool((positions == expected).all()):
            return None
        return Documents.from_positions(positions)
    offsets = batch.get("cu_seq_lens_q")
    if offsets is None:
        return None
    keys = batch.get("cu_seq_lens_k")
    if keys is not None and not torch.equal(torch.as_tensor(keys), torch.as_tensor(offsets)):
        raise PlaitError(
            f"context parallelism with {model_name}: cu_seq_lens_k differs from cu_seq_lens_q; "
            "a causal LM's queries and keys are the same packed documents"
        )
    return Documents.from_cu_seqlens(torch.as_tensor(offsets), seq_len, rows=rows)


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
