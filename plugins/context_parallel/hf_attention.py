"""Context parallelism for `transformers` models, through their own attention interface.

A `transformers` model calls its attention as `ALL_ATTENTION_FUNCTIONS[config.
_attn_implementation](module, query, key, value, attention_mask, dropout=, scaling=, …)` and
lets users register their own function under a new name (`AttentionInterface.register`,
then `model.set_attn_implementation(name)`), which is how this strategy enters: no model code
is patched. The registered function runs the strategy's `ContextParallelAttention` (ring,
Ulysses or both) on this rank's positions; transformers' mask builders make no mask for an
implementation they do not know, so the function receives `attention_mask=None` and attends
causally over the whole sequence (padding is checked when the batch is prepared,
`hf_batches`). Position ids and the shifted labels come with the batch.

Packed rows: `hf_batches` puts the micro-batch's `Documents` in the batch under
`DOCUMENTS_KEY`; the model's forward hands its keyword arguments down to the attention function
(checked in transformers 5.x for Llama, Mistral, Qwen2 and GPT-2), which masks with them. A
model that drops them on the way would attend across documents: a forward given documents in
which the attention function is called without them fails, naming the model.

One name is registered per model (`plait_cp_<strategy>_<n>`, removed when the model is
garbage-collected), so several models in one process each reach their own groups.

Refused by name: models whose attention does not go through the interface (transformers says
so with `_can_set_attn_implementation()`; a forward in which the function never ran is caught
too), attention dropout, soft-capping, attention sinks, bidirectional attention and sliding
windows shorter than the sequence. A scale other than `head_dim^-½` is folded into the query.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.core.errors import ConfigError, PlaitError
from plait.core.transformers_models import model_kind, transformers_package
from plait.core.transforms import ContextParallelism
from plait.plugins.context_parallel.attention import ContextParallelAttention, eager_under_compile
from plait.plugins.context_parallel.hf_batches import DOCUMENTS_KEY

_names = itertools.count()

# Configuration fields holding an attention dropout probability, by family.
DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


@dataclass
class TransformersAttention:
    """The function transformers calls as this model's attention implementation."""

    attend: ContextParallelAttention
    layout: ContextParallelism
    model_name: str
    calls: int = 0
    # Set by `AttentionWatch` while a forward given packed rows' documents runs.
    documents_expected: bool = False

    # NOTE: eager as a whole, not only the attention it runs: traced, the call counter is a
    # value Dynamo guards on, and the block would recompile at every step.
    @eager_under_compile
    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        self.calls += 1
        self._check(module, query, attention_mask, dropout, sliding_window, softcap, is_causal)
        if kwargs.get("s_aux") is not None:
            self._refuse("attention sinks (s_aux)")
        documents = kwargs.get(DOCUMENTS_KEY)
        if documents is None and self.documents_expected:
            self._refuse(
                f"packed rows: {type(module).__name__} does not hand the forward's keyword "
                f"arguments ({DOCUMENTS_KEY}) on to its attention function, so attention "
                "cannot be masked to each document"
            )
        head_dim = query.shape[-1]
        if scaling is not None and not math.isclose(scaling * math.sqrt(head_dim), 1.0):
            # The kernels scale scores by head_dim^-½: fold the model's own scale into q.
            query = query * (scaling * math.sqrt(head_dim))
        if documents is None:
            out = self.attend(query, key, value)
        else:
            out = self.attend(query, key, value, documents=documents)
        return out.transpose(1, 2), None

    def _check(
        self,
        module: nn.Module,
        query: torch.Tensor,
        attention_mask: Any,
        dropout: float,
        sliding_window: int | None,
        softcap: float | None,
        is_causal: bool | None,
    ) -> None:
        if attention_mask is not None:
            self._refuse(
                "an attention mask reaching attention (the model built one itself; padding "
                "given as a (batch, seq) attention_mask is handled before the batch is cut)"
            )
        if dropout:
            self._refuse(f"attention dropout ({dropout}); set the model's attention dropout to 0")
        if softcap:
            self._refuse(f"attention logit soft-capping ({softcap})")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not causal:
            self._refuse("bidirectional attention (is_causal = False)")
        length = query.shape[2] * self.layout.degree
        if sliding_window is not None and sliding_window < length:
            self._refuse(
                f"sliding-window attention (window {sliding_window}) over sequences of {length} "
                "tokens; ring and Ulysses attention are causal over the whole sequence"
            )

    def _refuse(self, what: str) -> None:
        raise PlaitError(
            f"context parallelism ({self.layout.strategy}) with {self.model_name}: {what} is "
            "not supported"
        )


def check_transformers_model(model: nn.Module, layout: ContextParallelism) -> None:
    """Refuse, by name, a `transformers` model this strategy cannot run."""
    name = model_kind(model)
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if not callable(can_set) or not can_set():
        raise ConfigError(
            f"context parallelism ({layout.strategy}) runs inside transformers' attention "
            f"interface (attn_implementation); {name} computes its attention itself, without "
            "AttentionInterface, so it cannot take part"
        )
    config = getattr(model, "config", None)
    for field in DROPOUT_FIELDS:
        rate = getattr(config, field, 0.0)
        if isinstance(rate, int | float) and rate > 0 and model.training:
            raise ConfigError(
                f"context parallelism ({layout.strategy}) with {name}: config.{field} = {rate}; "
                "attention dropout cannot be reproduced over a cut sequence: set it to 0"
            )


def install_transformers_attention(
    model: nn.Module, attend: ContextParallelAttention, layout: ContextParallelism
) -> TransformersAttention:
    """Register `attend` as `model`'s attention implementation (its own name) and select it."""
    transformers = transformers_package()
    assert transformers is not None
    check_transformers_model(model, layout)
    function = TransformersAttention(attend=attend, layout=layout, model_name=model_kind(model))
    name = f"plait_cp_{layout.strategy}_{next(_names)}"
    transformers.AttentionInterface.register(name, function)
    weakref.finalize(model, _unregister, transformers.AttentionInterface, name)
    model.set_attn_implementation(name)  # type: ignore[operator]
    chosen = getattr(model.config, "_attn_implementation", None)
    if chosen != name:
        raise ConfigError(
            f"context parallelism ({layout.strategy}): {model_kind(model)} kept attention "
            f"implementation {chosen!r} when asked for {name!r}"
        )
    watch = AttentionWatch(function)
    model.register_forward_pre_hook(watch.before, with_kwargs=True)
    model.register_forward_hook(watch.after)
    return function


def _unregister(interface: Any, name: str) -> None:
    interface._global_mapping.pop(name, None)


class AttentionWatch:
    """Fails a forward of the model in which the attention function never ran: the model
    computes attention some other way, and each rank would attend over its own positions. Tells
    the function whether the forward was given packed rows' documents, so that attention
    called without them fails rather than crossing documents."""

    def __init__(self, function: TransformersAttention) -> None:
        self.function = function
        self.calls_before = 0

    def before(self, module: nn.Module, args: Any, kwargs: dict[str, Any] | None = None) -> None:
        del module, args
        self.calls_before = self.function.calls
        self.function.documents_expected = (kwargs or {}).get(DOCUMENTS_KEY) is not None

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        del args, output
        self.function.documents_expected = False
        if self.function.calls == self.calls_before:
            raise PlaitError(
                f"context parallelism: a forward of {type(module).__name__} never called its "
                "attention implementation; its attention does not go through transformers' "
                "AttentionInterface, so each rank would attend over its own positions only"
            )
