"""Add LoRA adapters to a model with peft and freeze everything else.

The adapters are initialised from `train.seed` alone, in a forked random state, so every rank
(and a one-process run of the same config) starts from the same A matrices whatever it drew
before, and the job's own random stream is left where it was.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.core.errors import ConfigError, PluginError
from plait.core.transformers_models import is_transformers_model, transformers_package
from plait.plugins.lora.config import PeftSection, lora_config


def apply_lora(model: nn.Module, section: PeftSection, *, seed: int) -> nn.Module:
    """`model` wrapped by `peft.get_peft_model`: adapters on the targeted modules, the base
    weights frozen (`requires_grad=False`), so data parallelism reduces and optimises only the
    adapters (and `modules_to_save`)."""
    try:
        import peft
    except ImportError:
        raise PluginError(
            "parallel.transforms.adapter = 'lora' applies adapters with peft, which is not "
            "installed: pip install 'plait[peft]'"
        ) from None
    if isinstance(model, peft.PeftModel):
        raise ConfigError(
            f"the model is already a {type(model).__name__} with adapters "
            f"{sorted(model.peft_config)}: train it as it is and drop "
            "parallel.transforms.adapter, or pass the base model"
        )
    config = lora_config(section, task_type="CAUSAL_LM" if _is_causal_lm(model) else None)
    devices = [d.index or 0 for d in _devices(model) if d.type == "cuda"]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        try:
            adapted = peft.get_peft_model(model, config)
        except ValueError as exc:  # e.g. target modules not found in the model
            raise ConfigError(f"[peft]: {exc}") from None
    if not any(p.requires_grad for p in adapted.parameters()):
        raise ConfigError("[peft]: the adapter left no trainable parameter")
    return adapted


def _is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM (peft then wraps it so `labels` and generation pass through)."""
    transformers = transformers_package()
    if transformers is None or not is_transformers_model(model):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _devices(model: nn.Module) -> set[torch.device]:
    return {p.device for p in model.parameters()}
