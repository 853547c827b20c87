"""Pipeline stages of `transformers` causal LMs: the Llama family (Llama, Mistral, Qwen2) and GPT-2.

Each stage redoes, for its own blocks, what the model's top-level forward computes before the
loop over blocks — position ids, the rotary tables (Llama family) or position embeddings
(GPT-2, first stage), the causal (or sliding-window) attention mask — with the model's own
helpers (`create_causal_mask`, `rotary_emb`), from the micro-batch's `input_ids` shape and its
optional `attention_mask` / `position_ids`, and calls each block with exactly the arguments
the model's forward passes (no cache in training). The last stage applies the final norm and
the head and computes the loss with the model's own `loss_function` (which shifts the labels),
returning a `CausalLMOutputWithPast` as the whole model would.

Only hidden states `[micro_batch, seq, hidden]` cross a stage boundary; everything else is
recomputed from the batch, which every pipeline rank holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from plait.core.errors import PlaitError
from plait.plugins.pipeline.stages import ModelStage

# `config.model_type`s whose top-level forward is embed_tokens → (mask, rotary) → layers → norm
# → lm_head: checked line by line against transformers' modeling files, not inferred from the
# module names (Gemma has the same modules but scales its embeddings).
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
GPT2_FAMILY = ("gpt2",)
# Batch entries a transformers causal LM's forward hands on to its loss function.
LOSS_KEYWORDS = ("num_items_in_batch", "shift_labels")


def _batch_dict(batch: Any) -> Mapping[str, Any]:
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch
    raise PlaitError(
        "a pipelined transformers model takes dict batches with `input_ids` (and `labels` for "
        "its loss), as a Hugging Face data collator makes them"
    )


def _position_ids(batch: Mapping[str, Any], hidden: torch.Tensor) -> torch.Tensor:
    given = batch.get("position_ids")
    if isinstance(given, torch.Tensor):
        return given
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class _CausalLMStage(ModelStage):
    """What the supported families share: the batch, the mask and the last stage's loss."""

    def _mask_functions(self) -> dict[str, Callable[..., Any]]:
        from transformers.masking_utils import create_causal_mask

        return {"full_attention": create_causal_mask}

    def _masks(
        self, batch: Mapping[str, Any], hidden: torch.Tensor, position_ids: torch.Tensor
    ) -> dict[str, Any]:
        """One mask per attention type, as the model's forward builds them."""
        attention_mask = batch.get("attention_mask")
        if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(hidden.shape[0], -1)
        return {
            kind: make(
                config=self.full_model.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                past_key_values=None,
                position_ids=position_ids,
            )
            for kind, make in self._mask_functions().items()
        }

    def _output(self, hidden: torch.Tensor, batch: Mapping[str, Any]) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        model = self.full_model
        logits = model.lm_head(hidden)
        labels = batch.get("labels")
        loss = None
        if labels is not None:
            # What the model's forward passes its loss from the batch: a gradient-accumulation
            # count, and labels shifted over the whole sequence (context parallelism).
            given = {k: batch[k] for k in LOSS_KEYWORDS if batch.get(k) is not None}
            loss = model.loss_function(
                logits=logits, labels=labels, vocab_size=model.config.vocab_size, **given
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class LlamaFamilyStage(_CausalLMStage):
    """`model.embed_tokens` → `model.layers[i]` → `model.norm` → `lm_head`, with RoPE."""

    def _mask_functions(self) -> dict[str, Callable[..., Any]]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        config = self.full_model.config
        if getattr(config, "layer_types", None):  # Qwen2: a mask per attention type
            return {
                "full_attention": create_causal_mask,
                "sliding_attention": create_sliding_window_causal_mask,
            }
        if getattr(config, "sliding_window", None) is not None:  # Mistral
            return {"full_attention": create_sliding_window_causal_mask}
        return {"full_attention": create_causal_mask}

    def forward(self, hidden: torch.Tensor | None, batch: Any) -> Any:
        batch = _batch_dict(batch)
        decoder = self.full_model.model
        if hidden is None:
            hidden = decoder.embed_tokens(batch["input_ids"])
        position_ids = _position_ids(batch, hidden)
        masks = self._masks(batch, hidden, position_ids)
        position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
        layer_types = getattr(self.full_model.config, "layer_types", None)
        for name, block in self.parts.blocks:
            index = int(name.rsplit(".", 1)[1])
            kind = layer_types[index] if layer_types else "full_attention"
            hidden = block(
                hidden,
                attention_mask=masks[kind],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=None,
                use_cache=False,
            )
        if not self.parts.last:
            return hidden
        return self._output(decoder.norm(hidden), batch)


class GPT2Stage(_CausalLMStage):
    """`transformer.wte + wpe` → `drop` → `transformer.h[i]` → `ln_f` → `lm_head`."""

    def forward(self, hidden: torch.Tensor | None, batch: Any) -> Any:
        batch = _batch_dict(batch)
        transformer = self.full_model.transformer
        if hidden is None:
            embeds = transformer.wte(batch["input_ids"])
            position_ids = _position_ids(batch, embeds)
            hidden = transformer.drop(embeds + transformer.wpe(position_ids))
        else:
            position_ids = _position_ids(batch, hidden)
        mask = self._masks(batch, hidden, position_ids)["full_attention"]
        for _, block in self.parts.blocks:
            hidden = block(
                hidden,
                None,
                mask,
                None,
                encoder_attention_mask=None,
                use_cache=False,
                position_ids=position_ids,
            )
        if not self.parts.last:
            return hidden
        return self._output(transformer.ln_f(hidden), batch)
