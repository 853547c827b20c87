"""How a model takes packed rows: their `Documents` handed to it, left to transformers, or refused.

The engine reads each micro-batch's documents from its whole rows, before anything cuts them
(`plait.core.documents`), and asks `DocumentInputs.prepare` what the model is given:

- a model whose forward takes `documents=` (plait's own) gets them beside its `positions`;
- a transformers model of a family whose forward hands restarting `position_ids` to
  transformers' packed-sequence mask is given the batch as it is, and masks it itself;
- any other model, or a batch for which transformers would not build that mask, is refused by
  name: trained as it is, every token would attend to the documents before it.

`loss_counting` says which tokens the model's default loss is a mean over, for the token-weighted
step loss (`plait.core.token_loss`); `attention_square` gives the Σ nᵢ² the FLOPs count.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.core.batches import input_tokens
from plait.core.documents import Documents, documents_of, restarting_positions
from plait.core.errors import PlaitError
from plait.core.token_loss import LossCounting
from plait.core.transformers_models import is_transformers_model, model_kind

# transformers families whose forward hands restarting `position_ids` (and no cache) to
# `masking_utils.create_causal_mask` / `create_sliding_window_causal_mask`, which then find the
# documents (`find_packed_sequence_indices`) and mask between them. Checked in their modeling
# files and, document by document, in tests/unit/test_packed_hf.py; many other families build
# their mask without the position ids (or have none) and would attend across documents.
PACKED_FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
# Attention implementations whose mask transformers builds with the packed-sequence mask.
# flash-attention builds none: it finds varlen offsets in the position ids of one row only.
MASKED_ATTENTION = ("eager", "sdpa", "flex_attention")
FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")

# How a model takes packed rows (`DocumentInputs.mode`); any other mode is why it cannot.
TAKES_DOCUMENTS = "documents"
MASKS_ITSELF = "masks_itself"


@dataclass(frozen=True, slots=True)
class DocumentInputs:
    """What a model is given of packed rows, decided once from the model before it is sharded."""

    mode: str  # TAKES_DOCUMENTS, MASKS_ITSELF, or why the model cannot take packed rows
    attention: str = ""  # a transformers model's attention implementation

    @classmethod
    def of(cls, model: nn.Module) -> DocumentInputs:
        attention = str(getattr(getattr(model, "config", None), "_attn_implementation", ""))
        return cls(mode=_mode(model), attention=attention)

    def prepare(self, inputs: Any) -> Any:
        """A micro-batch of packed rows (position ids that restart) with its `Documents` added
        for a model that takes them; a model that cannot honour them is refused by name."""
        documents = documents_of(inputs)
        if documents is None:
            if self.mode == TAKES_DOCUMENTS and _plain_positions(inputs):
                # Rows of one sequence each (a packed sampler's row inside one document): their
                # positions are the default ones, dropped so that the piece context parallelism
                # cuts from them is not read as documents restarting.
                return {key: value for key, value in inputs.items() if key != "positions"}
            return inputs
        if self.mode == TAKES_DOCUMENTS:
            return {**inputs, "documents": documents}
        problem = self.mode
        if problem == MASKS_ITSELF:
            problem = _transformers_batch_problem(inputs, documents, self.attention)
            if problem is None:
                return inputs
        raise PlaitError(
            f"the batch holds packed documents (position ids that restart at 0 inside a row), "
            f"but {problem}: it would train every token on the documents before it. Give the "
            "model a `documents=` argument (plait.core.documents.Documents) and pass it to its "
            f"attention, use a transformers model of the {', '.join(PACKED_FAMILIES)} families, "
            "or send one document per row"
        )

    def loss_counting(self, model: nn.Module) -> LossCounting:
        """Which tokens the model's default loss is a mean over (`plait.core.token_loss`), known
        before the first step: a transformers causal LM's own loss over its shifted labels, plait's
        token cross-entropy against the targets for plait's models (they return logits). Any other
        model may return a loss of its own kind: its steps stay a mean of micro-batch losses."""
        if is_transformers_model(model):
            loss = getattr(model, "loss_function", None)
            own_causal_lm_loss = getattr(loss, "__name__", "") == "ForCausalLMLoss"
            return "shifted_labels" if own_causal_lm_loss else None
        return "targets" if self.mode == TAKES_DOCUMENTS else None


def _mode(model: nn.Module) -> str:
    """How `model` takes the document structure of packed rows: `"documents"` (its forward has
    a `documents=` argument, as plait's models do), `"masks_itself"` (a transformers model of a
    family that builds the block-diagonal mask from restarting position ids), or why it cannot
    (packed rows are then refused)."""
    if is_transformers_model(model):
        config = model.config
        kind = model_kind(model)
        if getattr(config, "model_type", None) not in PACKED_FAMILIES:
            return f"{kind} is not of a family whose forward masks packed rows"
        attention = getattr(config, "_attn_implementation", None)
        if attention not in (*MASKED_ATTENTION, *FLASH_ATTENTION):
            return (
                f"{kind} uses attention implementation {attention!r}, for which transformers "
                f"builds no packed-sequence mask (it does for {', '.join(MASKED_ATTENTION)})"
            )
        return MASKS_ITSELF
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    if "documents" in parameters:
        return TAKES_DOCUMENTS
    return f"{type(model).__name__}.forward takes no documents= argument to mask attention with"


def _transformers_batch_problem(inputs: Any, documents: Documents, attention: str) -> str | None:
    """Why a transformers model would not mask this packed micro-batch, or `None`. transformers
    looks for documents in the position ids only when no 2-D `attention_mask` is given, and
    its flash-attention path only in a micro-batch of one row."""
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        return (
            "it also carries a 2-D attention_mask, and transformers then ignores the documents "
            "its position ids show (leave attention_mask out of packed batches, as "
            "DataCollatorWithFlattening does)"
        )
    if restarting_positions(inputs) is None and attention not in FLASH_ATTENTION:
        return (
            f"its documents are given only as cu_seq_lens_q/k, which transformers' {attention} "
            "attention does not read (flash-attention does); give restarting position_ids "
            "as well, as DataCollatorWithFlattening does"
        )
    if attention in FLASH_ATTENTION and documents.rows > 1:
        return (
            f"transformers' {attention} finds documents in the position ids of a micro-batch "
            f"of one row only, and this one has {documents.rows} (set train.micro_batch_size = 1 "
            "or pack each micro-batch into one row)"
        )
    return None


def _plain_positions(inputs: Any) -> bool:
    """Whether a micro-batch carries `positions` (rows, seq) that are 0 … seq − 1 on every row."""
    positions = inputs.get("positions") if isinstance(inputs, Mapping) else None
    return isinstance(positions, torch.Tensor) and positions.ndim == 2


def attention_square(microbatch: Any) -> tuple[int, bool]:
    """Σ nᵢ² over a micro-batch's documents (a row of one sequence counts T²), and whether it
    holds packed rows."""
    documents = microbatch.get("documents") if isinstance(microbatch, Mapping) else None
    if documents is None:
        documents = documents_of(microbatch)
    if documents is None:
        tokens = input_tokens(microbatch)
        return tokens.shape[0] * tokens.shape[-1] ** 2, False
    return int((documents.lengths() ** 2).sum()), True
