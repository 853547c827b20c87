"""How `transformers` models take packed rows: the huggingface plugin's answer to
`plait_model_inputs`.

A `transformers` model of a family whose forward hands restarting `position_ids` to
transformers' packed-sequence mask is given the batch as it is, and masks it itself; a model of
another family, an attention implementation for which transformers builds no such mask, or a
batch it would not mask (a 2-D `attention_mask` beside the positions, varlen offsets an
attention ignores, several rows under flash-attention) is refused by name: trained as it is,
every token would attend to the documents before it. Its loss is transformers' own causal-LM
loss over the shifted labels, when the model uses it (`plait.core.token_loss`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.core.document_inputs import packed_rows_refused
from plait.core.documents import Documents, documents_of, restarting_positions
from plait.core.hookspecs import hookimpl
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

# How a transformers model takes packed rows (`TransformersInputs.mode`); any other mode is why
# it cannot.
MASKS_ITSELF = "masks_itself"
# What a refusal suggests instead.
INSTEAD = f"use a transformers model of the {', '.join(PACKED_FAMILIES)} families, "


@dataclass(frozen=True, slots=True)
class TransformersInputs:
    """What a `transformers` model is given of packed rows, decided once before it is sharded."""

    mode: str  # MASKS_ITSELF, or why the model cannot take packed rows
    attention: str = ""  # the model's attention implementation

    @classmethod
    def of(cls, model: nn.Module) -> TransformersInputs:
        attention = str(getattr(getattr(model, "config", None), "_attn_implementation", ""))
        return cls(mode=_mode(model), attention=attention)

    def prepare(self, inputs: Any) -> Any:
        """The micro-batch as it is, when transformers will mask its packed rows; refused by
        name when it would not."""
        documents = documents_of(inputs)
        if documents is None:
            return inputs
        problem = self.mode
        if problem == MASKS_ITSELF:
            problem = _transformers_batch_problem(inputs, documents, self.attention)
            if problem is None:
                return inputs
        raise packed_rows_refused(problem, instead=INSTEAD)

    def loss_counting(self, model: nn.Module) -> LossCounting:
        """A causal LM's own loss is a mean over its shifted labels; any other loss is the
        model's own kind (its steps stay a mean of micro-batch losses)."""
        loss = getattr(model, "loss_function", None)
        own_causal_lm_loss = getattr(loss, "__name__", "") == "ForCausalLMLoss"
        return "shifted_labels" if own_causal_lm_loss else None


@hookimpl
def plait_model_inputs(model: nn.Module) -> TransformersInputs | None:
    return TransformersInputs.of(model) if is_transformers_model(model) else None


def _mode(model: nn.Module) -> str:
    """`"masks_itself"` (a family that builds the block-diagonal mask from restarting position
    ids), or why the model cannot take packed rows."""
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
