"""Recognising a Hugging Face `transformers` model, without importing `transformers`.

Tensor, context and expert parallelism and the HF export each adapt a `transformers` model
through the library's own extension points (its tensor-parallel plan, `AttentionInterface`,
`ExpertsInterface`, `save_pretrained`); they ask here whether a model is one. A model can only
be a `transformers` model when the package is already imported, so plait never imports it for
users who do not use it.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn


def transformers_package() -> Any | None:
    """The imported `transformers` package, or `None` when nothing has imported it."""
    return sys.modules.get("transformers")


def is_transformers_model(model: nn.Module) -> bool:
    """Whether `model` is a `transformers.PreTrainedModel` (an unwrapped HF model)."""
    transformers = transformers_package()
    if transformers is None:
        return False
    return isinstance(model, transformers.PreTrainedModel)


def model_kind(model: nn.Module) -> str:
    """`ClassName` or `ClassName (transformers model_type 'x')`, for error messages."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = type(model).__name__
    return f"{name} (transformers model_type {model_type!r})" if model_type else name


def prepare_for_training(model: nn.Module) -> None:
    """Set what a `transformers` model needs to train under plait (nothing for another model):
    no KV cache. A training step never wants one, and holding one, transformers also skips the
    block-diagonal mask of packed rows (their restarting position ids)."""
    if is_transformers_model(model):
        model.config.use_cache = False
