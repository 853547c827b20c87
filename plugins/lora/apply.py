"""Add LoRA adapters to a model with peft and freeze everything else.

The adapters are initialised from `train.seed` alone, in a forked random state, so every rank
(and a one-process run of the same config) starts from the same A matrices whatever it drew
before, and the job's own random stream is left where it was. A pipeline stage continues the
stream where the stage before it left it (`add_adapters`' `start`), so the stages together draw
what one process draws for the whole model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from plait.core.errors import ConfigError, PluginError
from plait.core.transformers_models import is_transformers_model, transformers_package
from plait.plugins.lora.config import PeftSection, lora_config


def apply_lora(model: nn.Module, section: PeftSection, *, seed: int) -> nn.Module:
    """`model` wrapped by `peft.get_peft_model`: adapters on the targeted modules, the base
    weights frozen (`requires_grad=False`), so data parallelism reduces and optimises only the
    adapters (and `modules_to_save`)."""
    return add_adapters(model, section, seed=seed)[0]


def add_adapters(
    model: nn.Module,
    section: PeftSection,
    *,
    seed: int,
    start: torch.Tensor | None = None,
    custom_layers: Mapping[type, type] | None = None,
) -> tuple[nn.Module, torch.Tensor]:
    """`apply_lora`, drawing from CPU random state `start` (`torch.get_rng_state()`'s form)
    instead of `seed` when given; also the CPU random state after the draws. peft draws every
    adapter on the CPU, in module order, before moving it to its layer's device.
    `custom_layers`: adapter layers for layer classes peft does not know (by base class)."""
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
    config = lora_config(section, task_type=task_type_of(model))
    if custom_layers:
        config._register_custom_module(dict(custom_layers))
    devices = [d.index or 0 for d in _devices(model) if d.type == "cuda"]
    with torch.random.fork_rng(devices=devices):
        if start is None:
            torch.manual_seed(seed)
        else:
            torch.set_rng_state(start)
        try:
            adapted = peft.get_peft_model(model, config)
        except ValueError as exc:  # e.g. target modules not found in the model
            raise ConfigError(f"[peft]: {exc}") from None
        end = torch.get_rng_state()
    if not any(p.requires_grad for p in adapted.parameters()):
        raise ConfigError("[peft]: the adapter left no trainable parameter")
    return adapted, end


def task_type_of(model: nn.Module) -> str | None:
    """peft's task type for `model`: "CAUSAL_LM" for a transformers causal LM, else none."""
    return "CAUSAL_LM" if _is_causal_lm(model) else None


def _is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM (peft then wraps it so `labels` and generation pass through)."""
    transformers = transformers_package()
    if transformers is None or not is_transformers_model(model):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _devices(model: nn.Module) -> set[torch.device]:
    return {p.device for p in model.parameters()}
