"""The built-in model families, "llama", "gpt2" and "moe", and the preset lookup the engine uses.

`resolve_model_config(name, size, overrides)` turns the `[model]` config section into a family's
validated config; `plait_register_models` hands the engine one `ModelRecord` per family, whose
`build(config, kernels)` constructs the module (on the meta device when the engine asks) and
whose `flops_per_token(config, seq_len)` feeds MFU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from plait.core.errors import ConfigError
from plait.core.hookspecs import hookimpl
from plait.core.records import ModelRecord
from plait.plugins.models.common import ModelConfig, TransformerBase, flops_per_token
from plait.plugins.models.gpt2 import GPT2, GPT2Config, build_gpt2
from plait.plugins.models.llama import Llama, LlamaConfig, build_llama
from plait.plugins.models.moe import MoE, MoEConfig, build_moe, moe_flops_per_token

__all__ = [
    "GPT2",
    "MODEL_CONFIGS",
    "GPT2Config",
    "Llama",
    "LlamaConfig",
    "MoE",
    "MoEConfig",
    "ModelConfig",
    "TransformerBase",
    "plait_register_models",
    "resolve_model_config",
]

MODEL_CONFIGS: dict[str, type[ModelConfig]] = {
    "llama": LlamaConfig,
    "gpt2": GPT2Config,
    "moe": MoEConfig,
}


def resolve_model_config(
    name: str, size: str, overrides: Mapping[str, Any] | None = None
) -> ModelConfig:
    """The validated config of family `name`, preset `size`, with field `overrides` applied.

    Raises `ConfigError` naming the allowed families, presets or fields.
    """
    if name not in MODEL_CONFIGS:
        raise ConfigError(
            f"model.name: no built-in model family {name!r}; allowed: {', '.join(MODEL_CONFIGS)}"
        )
    return MODEL_CONFIGS[name].from_preset(size, overrides)


@hookimpl
def plait_register_models() -> Sequence[ModelRecord]:
    return [
        ModelRecord(
            name="llama",
            config_cls=LlamaConfig,
            build=build_llama,
            flops_per_token=flops_per_token,
            presets=tuple(LlamaConfig.presets),
            make_config=LlamaConfig.from_preset,
            description="Llama 2 architecture: RMSNorm, RoPE, grouped-query attention, SwiGLU",
        ),
        ModelRecord(
            name="gpt2",
            config_cls=GPT2Config,
            build=build_gpt2,
            flops_per_token=flops_per_token,
            presets=tuple(GPT2Config.presets),
            make_config=GPT2Config.from_preset,
            description="GPT-2 architecture (untied embeddings): LayerNorm, learned positions",
        ),
        ModelRecord(
            name="moe",
            config_cls=MoEConfig,
            build=build_moe,
            flops_per_token=moe_flops_per_token,
            presets=tuple(MoEConfig.presets),
            make_config=MoEConfig.from_preset,
            description="Mixtral / DeepSeek-MoE: Llama blocks with routed and shared experts",
        ),
    ]
