"""The `lora` transform's section, its checks and how it adds adapters (one process, no ranks).

Equality with one process under DDP and ZeRO is `tests/dist/test_lora.py`'s.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.core.config import load_config
from plait.core.errors import ConfigError
from plait.plugins.lora import PeftSection, apply_lora, lora_config, plait_configure

peft = pytest.importorskip("peft")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(16, 16)
        self.wo = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.relu(self.wq(x)))


class Tiny(nn.Module):
    """Not a transformers model: peft wraps it in a plain `PeftModel`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_section_keys_become_peft_lora_config() -> None:
    section = PeftSection(r=4, alpha=32, dropout=0.1, target_modules=["wq"], bias="lora_only")
    config = lora_config(section, task_type=None)
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 32, 0.1)
    assert set(config.target_modules) == {"wq"} and config.bias == "lora_only"
    assert config.init_lora_weights is True and config.task_type is None


def test_adapters_train_and_the_base_is_frozen() -> None:
    section = PeftSection(r=4, target_modules=["wq", "wo"])
    adapted = apply_lora(Tiny(), section, seed=3)
    assert isinstance(adapted, peft.PeftModel)
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    # 2 blocks × 2 layers × (A: 4 × 16 + B: 16 × 4)
    assert sum(p.numel() for p in adapted.parameters() if p.requires_grad) == 2 * 2 * 128
    frozen = [p for p in adapted.parameters() if not p.requires_grad]
    assert sum(p.numel() for p in frozen) == sum(p.numel() for p in Tiny().parameters())


def test_adapters_come_from_the_seed_alone() -> None:
    section = PeftSection(r=4, target_modules=["wq"])
    bases = [Tiny(), Tiny(), Tiny()]
    torch.manual_seed(123)
    first = apply_lora(bases[0], section, seed=5)
    # The job's own random stream is left where it was.
    drawn_after = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(4), drawn_after)
    # Another random state before: the same adapters; another seed: others.
    second = apply_lora(bases[1], section, seed=5)
    third = apply_lora(bases[2], section, seed=6)

    def a_matrices(model: nn.Module) -> list[torch.Tensor]:
        return [p for n, p in model.named_parameters() if "lora_A" in n]

    pairs = zip(a_matrices(first), a_matrices(second), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not torch.equal(a_matrices(first)[0], a_matrices(third)[0])


def test_a_peft_model_is_not_adapted_twice() -> None:
    section = PeftSection(target_modules=["wq"])
    adapted = apply_lora(Tiny(), section, seed=0)
    with pytest.raises(ConfigError, match="already a PeftModel"):
        apply_lora(adapted, section, seed=0)


def test_targets_that_match_nothing_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"\[peft\]"):
        apply_lora(Tiny(), PeftSection(target_modules=["q_proj"]), seed=0)


def test_peft_section_without_the_transform_is_refused() -> None:
    config = load_config({"peft": {"r": 4}})
    with pytest.raises(ConfigError, match="no adapter is applied"):
        plait_configure(config=config)


def test_tensor_parallel_is_accepted_alone_and_with_pipeline_parallel() -> None:
    lora = {"transforms": {"adapter": "lora"}}
    plait_configure(config=load_config({"parallel": {"tp": 2, **lora}}))
    plait_configure(config=load_config({"parallel": {"tp": 2, "pp": 2, **lora}}))


def test_pipeline_is_accepted_with_one_chunk_per_rank() -> None:
    lora = {"transforms": {"adapter": "lora"}}
    plait_configure(config=load_config({"parallel": {"pp": 2, **lora}}))
    virtual = {"parallel": {"pp": 2, **lora}, "schedule": {"virtual_stages": 2}}
    with pytest.raises(ConfigError, match="virtual_stages = 2"):
        plait_configure(config=load_config(virtual))


def test_the_transform_alone_is_accepted() -> None:
    plait_configure(config=load_config({"parallel": {"transforms": {"adapter": "lora"}}}))


def test_modules_to_save_are_refused_under_pipeline_or_tensor_parallelism() -> None:
    lora = {"transforms": {"adapter": "lora"}}
    saved = {"peft": {"modules_to_save": ["output"]}}
    plait_configure(config=load_config({"parallel": {"dp_strategy": "zero3", **lora}, **saved}))
    for degrees, named in (({"pp": 2}, "parallel.pp = 2"), ({"tp": 2}, "parallel.tp = 2")):
        with pytest.raises(ConfigError, match=rf"modules_to_save = \['output'\] with {named}"):
            plait_configure(config=load_config({"parallel": {**degrees, **lora}, **saved}))


def test_a_module_to_save_trains_as_a_copy_beside_its_frozen_original() -> None:
    """peft's names: the frozen original `….original_module.…`, the copy that trains
    `….modules_to_save.default.…`, starting equal; the base's checkpoint names both as the
    module's own."""
    from plait.plugins.lora.state import base_weight_name, trained_copies

    section = PeftSection(r=2, target_modules=["wq"], modules_to_save=["layers.1.wo"])
    adapted = apply_lora(Tiny(), section, seed=0)
    params = dict(adapted.named_parameters())
    original = params["base_model.model.layers.1.wo.original_module.weight"]
    copy = params["base_model.model.layers.1.wo.modules_to_save.default.weight"]
    assert copy.requires_grad and not original.requires_grad
    assert torch.equal(copy, original) and copy.data_ptr() != original.data_ptr()
    pairs = trained_copies(adapted)
    assert pairs[id(copy)] == id(original) and len(pairs) == 2  # weight and bias
    for name in ("original_module", "modules_to_save.default"):
        assert (
            base_weight_name(f"base_model.model.layers.1.wo.{name}.weight") == "layers.1.wo.weight"
        )
