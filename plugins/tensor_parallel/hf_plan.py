"""Tensor-parallel plans that Hugging Face `transformers` models declare, in plait's styles.

A `transformers` model carries its plan as `model._tp_plan` (full module names) or
`config.base_model_tp_plan` (names under `base_model_prefix`). Each of its styles either maps to
a plait style or is refused by name, with the list plait supports:

| transformers | plait | what |
|---|---|---|
| `colwise` | `colwise` | split output features |
| `rowwise`, `rowwise_rep` | `rowwise` | split input features, all-reduce (or reduce-scatter) out |
| `colwise_gather_output`, `colwise_rep` | `colwise_gather` | split output features, gather |
| `embedding_rowwise` | `vocab` | split the vocabulary rows of an embedding |
| `sequence_parallel`, `replicate`, `replicated_with_grad_allreduce` | `none` | replicated |

Replicated modules need nothing from the plan: plait's own `[tp] sequence_parallel` splits the
norms' sequence and sums every replicated parameter's partial gradient over tp.

Families whose `transformers` classes declare no plan get plait's (`UNDECLARED_PLANS`, in
plait's styles): GPT-2 fuses q, k and v into one `Conv1D` (`c_attn`, split `colwise_qkv`: each
third by whole heads) and ties its head to the token embedding (both split by vocabulary rows,
so each rank's head shard is its embedding shard).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.core.errors import ConfigError

HF_STYLES: dict[str, str] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "rowwise_rep": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather",
    "embedding_rowwise": "vocab",
    "sequence_parallel": "none",
    "replicate": "none",
    "replicated_with_grad_allreduce": "none",
}


def declared_hf_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan a `transformers` model declares (full module names), or `None` if it is not
    such a model or declares none."""
    config = getattr(model, "config", None)
    own = getattr(model, "_tp_plan", None)
    if own:
        return dict(own)
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    nested = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    return {(f"{prefix}.{k}" if nested else k): v for k, v in base.items()}


# Plans, in plait's styles and named under `base_model_prefix`, for `transformers` families that
# declare none; `HEAD_STYLE` is added for the model's `lm_head` when it has one.
UNDECLARED_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {
        "wte": "vocab",
        "h.*.attn.c_attn": "colwise_qkv",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
}
HEAD_STYLE = ("lm_head", "colwise_gather")


def undeclared_hf_plan(model: nn.Module) -> dict[str, str] | None:
    """plait's plan (full module names, plait's styles) for a `transformers` family that
    declares none, or `None` if plait has none for it either."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    base = UNDECLARED_PLANS.get(model_type) if isinstance(model_type, str) else None
    if base is None:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    nested = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    plan = {(f"{prefix}.{k}" if nested else k): v for k, v in base.items()}
    head, style = HEAD_STYLE
    if isinstance(getattr(model, head, None), nn.Linear):
        plan[head] = style
    return plan


def translate_hf_plan(plan: dict[str, str]) -> dict[str, str]:
    """`plan` in plait's styles; an unsupported transformers style is an error naming it."""
    refused = {name: style for name, style in plan.items() if style not in HF_STYLES}
    if refused:
        raise ConfigError(
            f"tp.plan: the model's transformers plan uses style(s) plait does not implement: "
            f"{refused}; supported transformers styles: {', '.join(sorted(HF_STYLES))} (or "
            "override those entries with [tp] plan = {pattern = style})"
        )
    return {name: HF_STYLES[style] for name, style in plan.items()}


def is_hf_model(model: nn.Module) -> bool:
    return getattr(model, "config", None) is not None and hasattr(model, "base_model_prefix")


def hf_head_counts(attention: nn.Module) -> tuple[int, int] | None:
    """(query heads, key/value heads) from a `transformers` attention module's config."""
    config: Any = getattr(attention, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads
