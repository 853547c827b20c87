"""`[peft]`: the LoRA adapter the `lora` transform adds, declared by the plugin that applies it.

    [parallel]
    transforms = { adapter = "lora" }

    [peft]
    r = 8                                  # rank of each adapter
    alpha = 16                             # scale alpha / r (alpha / sqrt(r) with use_rslora)
    dropout = 0.0
    target_modules = ["q_proj", "v_proj"]  # or "all-linear"

The keys are those of peft's `LoraConfig` under the names a config file wants (`alpha` for
`lora_alpha`, `dropout` for `lora_dropout`); `lora_config` builds the peft object from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from plait.core.config import PlaitConfig, Section

if TYPE_CHECKING:
    from peft import LoraConfig

SECTION = "peft"


class PeftSection(Section):
    """`[peft]` section: a LoRA adapter on the base model's linear layers."""

    r: int = Field(8, gt=0, description="rank of each adapter (A: r × in, B: out × r)")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: updates are alpha / r × BA")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="module names (suffixes) that get an adapter, or 'all-linear' (every linear "
        "layer but the output head)",
    )
    exclude_modules: list[str] = Field(
        default_factory=list, description="module names never adapted, even when targeted"
    )
    bias: Literal["none", "all", "lora_only"] = Field(
        "none", description="which biases train: none, every bias, or the adapted layers' only"
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="modules trained in full beside the adapters (e.g. a new head)",
    )
    use_rslora: bool = Field(False, description="rank-stabilised scale alpha / sqrt(r)")
    init: Literal["default", "gaussian"] = Field(
        "default",
        description="A's initialisation (B starts at zero, so training starts from the base "
        "model): default is Kaiming-uniform, gaussian is N(0, 1/r)",
    )
    layers_to_transform: list[int] = Field(
        default_factory=list, description="block indices that get adapters; empty = all"
    )


def peft_section(config: PlaitConfig) -> PeftSection:
    """The job's `[peft]` section (defaults where the file has none)."""
    return config.section(SECTION, PeftSection)


def lora_config(section: PeftSection, *, task_type: str | None) -> LoraConfig:
    """peft's `LoraConfig` for `section`; `task_type` "CAUSAL_LM" for a transformers causal LM
    (peft then wraps it in `PeftModelForCausalLM`), `None` for any other module."""
    from peft import LoraConfig

    return LoraConfig(
        r=section.r,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=section.target_modules,
        exclude_modules=section.exclude_modules or None,
        bias=section.bias,
        modules_to_save=section.modules_to_save or None,
        use_rslora=section.use_rslora,
        init_lora_weights=True if section.init == "default" else "gaussian",
        layers_to_transform=section.layers_to_transform or None,
        task_type=task_type,
    )
