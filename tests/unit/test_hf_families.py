"""HF checkpoints both ways for Llama, Mistral, Qwen2 and GPT-2, judged by transformers itself.

plait -> HF: `export_hf` writes a folder that `AutoModelForCausalLM.from_pretrained` loads with
plait's logits. HF -> plait: a tiny transformers model built from a config and saved with
`save_pretrained` is imported by `import_hf` into a plait model with the HF logits. Every
parameter is random (biases and norm scales included), so a misplaced tensor shows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from plait.core.errors import CheckpointError  # noqa: E402
from plait.core.kernels import Kernels  # noqa: E402
from plait.plugins.huggingface.families import FAMILIES, Slot  # noqa: E402
from plait.plugins.huggingface.weights import export_hf, import_hf, model_fields  # noqa: E402
from plait.plugins.models import GPT2, Llama, resolve_model_config  # noqa: E402

TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
ATOL = 1e-5

# Non-default theta and eps, so a config.json that lost them loads a different model.
LLAMA = {"dim": 32, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 16, "max_seq_len": 32,
         "rope_theta": 500000.0, "norm_eps": 1e-5}  # fmt: skip
PLAIT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", LLAMA),
    "mistral": ("llama", LLAMA),
    "qwen2": ("llama", {**LLAMA, "qkv_bias": True}),
    "gpt2": ("gpt2", {"dim": 32, "n_heads": 4, "max_seq_len": 32, "norm_eps": 1e-4}),
}
LLAMA_HF = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                rms_norm_eps=1e-5, rope_theta=250000.0)  # fmt: skip
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": LLAMA_HF,
    "mistral": {**LLAMA_HF, "sliding_window": None},
    "qwen2": {**LLAMA_HF, "tie_word_embeddings": True},
    "gpt2": dict(
        vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=32, layer_norm_epsilon=1e-4
    ),
}


def randomise(model: nn.Module, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval()


def plait_model(plugins: Any, name: str, overrides: dict[str, Any]) -> nn.Module:
    config = resolve_model_config(name, "tiny", overrides)
    return {"llama": Llama, "gpt2": GPT2}[name](config, Kernels(plugins))  # type: ignore[arg-type]


def hf_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def export_plait(plugins: Any, family: str, folder: Path) -> torch.Tensor:
    """Export a random plait model of `family` to `folder`; returns its logits."""
    name, overrides = PLAIT_MODELS[family]
    model = randomise(plait_model(plugins, name, overrides), seed=1)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    fields = model_fields(model.config)  # type: ignore[arg-type]
    export_hf(weights, folder, model=name, fields=fields, family=family)
    with torch.no_grad():
        return model(TOKENS)


def save_transformers(family: str, folder: Path, **changes: Any) -> torch.Tensor:
    """Save a random tiny transformers model of `family` to `folder`; returns its logits."""
    config = transformers.AutoConfig.for_model(family, **{**HF_CONFIGS[family], **changes})
    model = randomise(transformers.AutoModelForCausalLM.from_config(config), seed=2)
    model.save_pretrained(folder)
    with torch.no_grad():
        return model(TOKENS).logits


def import_plait(plugins: Any, folder: Path) -> tuple[torch.Tensor, Any]:
    imported = import_hf(folder)
    model = plait_model(plugins, imported.model, imported.overrides).eval()
    model.load_state_dict(imported.weights, strict=True)
    with torch.no_grad():
        return model(TOKENS), imported


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers_with_equal_logits(plugins, tmp_path: Path, family) -> None:
    ours = export_plait(plugins, family, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == family
    assert config["architectures"] == [FAMILIES[family].architecture]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == FAMILIES[family].architecture
    torch.testing.assert_close(hf_logits(tmp_path), ours, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_transformers_folder_imports_with_equal_logits(plugins, tmp_path: Path, family) -> None:
    theirs = save_transformers(family, tmp_path)
    ours, imported = import_plait(plugins, tmp_path)
    assert imported.family.model_type == family
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_tied_qwen2_and_gpt2_import_untied_copies(plugins, tmp_path: Path) -> None:
    """Both configs tie (GPT2Config by default): only the embedding is saved."""
    for family in ("qwen2", "gpt2"):
        folder = tmp_path / family
        theirs = save_transformers(family, folder)
        ours, imported = import_plait(plugins, folder)
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
        assert torch.equal(
            imported.weights["output.weight"], imported.weights["tok_embeddings.weight"]
        )
        assert any("tied" in note for note in imported.notes)


def test_mistral_sliding_window_caps_sequence_length(plugins, tmp_path: Path) -> None:
    """Up to the window, sliding attention is causal attention: logits agree up to it."""
    theirs = save_transformers("mistral", tmp_path, sliding_window=12)
    ours, imported = import_plait(plugins, tmp_path)
    assert imported.overrides["max_seq_len"] == 12
    assert any("sliding attention window 12" in note for note in imported.notes)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_block_reads_of_fused_transposed_tensors() -> None:
    """A sharded rank reads a block of q/k/v out of GPT-2's [in, 3·out] c_attn."""
    c_attn = torch.arange(4 * 12.0).view(4, 12)
    for part in range(3):
        slot = Slot("c_attn.weight", transpose=True, part=part, parts=3)
        whole = slot.extract(c_attn)
        assert torch.equal(whole, c_attn[:, 4 * part : 4 * part + 4].T)
        block = [slice(1, 3), slice(2, 4)]
        assert torch.equal(slot.read(c_attn, c_attn.shape, block), whole[1:3, 2:4])


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3'"),
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"head_dim": 16}, "head_dim 16"),
        ("gpt2", {"activation_function": "relu"}, "activation_function 'relu'"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ],
)
def test_layouts_plait_cannot_hold_are_refused_by_name(
    family: str, changes: dict[str, Any], message: str
) -> None:
    config = {"model_type": family, **HF_CONFIGS[family], **changes}
    with pytest.raises(CheckpointError, match=message):
        FAMILIES[family].from_config(config)


def test_exports_refuse_families_that_cannot_hold_the_model(plugins, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="export it as qwen2"):
        _export_as(plugins, "llama", tmp_path)
    with pytest.raises(CheckpointError, match="exports as llama, mistral, qwen2, not gpt2"):
        _export_as(plugins, "gpt2", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(CheckpointError, match="model_type 'mixtral' is not supported"):
        import_hf(tmp_path)


def _export_as(plugins: Any, family: str, folder: Path) -> None:
    """A Qwen2-layout plait model (q/k/v biases) exported as `family`."""
    model = plait_model(plugins, "llama", PLAIT_MODELS["qwen2"][1])
    weights = {n: p.detach() for n, p in model.named_parameters()}
    fields = model_fields(model.config)  # type: ignore[arg-type]
    export_hf(weights, folder, model="llama", fields=fields, family=family)


def test_gpt2_base_model_layout_imports(plugins, tmp_path: Path) -> None:
    """The hub's `gpt2` is a `GPT2Model` (no `transformer.` prefix, no `lm_head`, tied)."""
    config = transformers.GPT2Config(**HF_CONFIGS["gpt2"])
    base = randomise(transformers.GPT2Model(config), seed=3)
    base.save_pretrained(tmp_path)
    head = transformers.GPT2LMHeadModel(config).eval()
    head.transformer.load_state_dict(base.state_dict())
    head.tie_weights()
    with torch.no_grad():
        theirs = head(TOKENS).logits
    ours, imported = import_plait(plugins, tmp_path)
    assert imported.family.model_type == "gpt2"
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
