"""A LoRA job's checkpoint holds the adapters and their optimizer state, not the frozen base
(named and hashed instead, and checked at resume); `plait ckpt export --format peft` writes a
folder `peft.PeftModel.from_pretrained` loads onto the base with the job's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import plait
from plait.core.errors import CheckpointError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 96
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
CONFIG = {
    "telemetry": {"enabled": False},
    "train": {"device": "cpu", "seed": 3},
    "parallel": {"transforms": {"adapter": "lora"}},
    "peft": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
}


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def engine_for(model: nn.Module) -> Any:
    return plait.initialize(
        model, config=CONFIG, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    )


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, torch.Tensor, int]:
    """A checkpoint after 3 steps; the logits then, and the number of adapter parameters."""
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig

    engine = engine_for(build())
    checkpointer = Checkpointer(engine, None, CheckpointIOConfig(dir=str(tmp_path / "ckpt")))
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(step))
        engine.train_step({"input_ids": tokens, "labels": tokens})
    checkpointer.save(3)
    checkpointer.close()
    adapters = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    trained = logits(engine.module)
    engine.close()
    return tmp_path / "ckpt", trained, adapters


def test_checkpoint_holds_adapters_and_their_state_only(checkpoint: tuple) -> None:
    from plait.plugins.checkpoint.offline import model_weights, read_checkpoint

    path, _, adapters = checkpoint
    weights, _ = model_weights(path)
    assert weights and all(".lora_" in name for name in weights)
    assert sum(t.numel() for t in weights.values()) == adapters
    optim = {k: v for k, v in read_checkpoint(path, prefix="optim.").items() if torch.is_tensor(v)}
    moments = [v for k, v in optim.items() if k.endswith(("exp_avg", "exp_avg_sq"))]
    assert moments and all(".lora_" in k for k in optim)
    assert sum(t.numel() * t.element_size() for t in moments) == 8 * adapters


def test_resume_restores_the_adapters_on_the_same_base(checkpoint: tuple) -> None:
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig
    from plait.plugins.checkpoint.storage import resolve_checkpoint

    root, trained, _ = checkpoint
    path = resolve_checkpoint(root)
    engine = engine_for(build())
    Checkpointer(engine, None, CheckpointIOConfig(dir=str(root))).load(path)
    torch.testing.assert_close(logits(engine.module), trained, atol=1e-5, rtol=0)
    engine.close()

    other = engine_for(build(seed=1))  # another base: the adapters would not fit it
    with pytest.raises(CheckpointError, match="trained on base"):
        Checkpointer(other, None, CheckpointIOConfig(dir=str(root))).load(path)
    other.close()


def test_export_loads_with_peft_onto_the_base(checkpoint: tuple, tmp_path: Path) -> None:
    from plait.tools.ckpt_commands import app

    path, trained, adapters = checkpoint
    out = CliRunner().invoke(
        app, ["export", str(path), "--format", "peft", "-o", str(tmp_path / "adapter")]
    )
    assert out.exit_code == 0, out.output
    # The files are those peft itself writes for the same adapters: tensor names, config.
    from safetensors import safe_open

    own = peft.get_peft_model(
        build(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    own.save_pretrained(tmp_path / "peft_own")
    names = {}
    for folder in ("adapter", "peft_own"):
        with safe_open(tmp_path / folder / "adapter_model.safetensors", "pt") as f:
            names[folder] = set(f.keys())
    assert names["adapter"] == names["peft_own"]
    config = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    assert (config.r, config.lora_alpha) == (4, 8)
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    loaded = peft.PeftModel.from_pretrained(build(), tmp_path / "adapter")
    assert loaded.peft_config["default"].r == 4
    assert sum(p.numel() for n, p in loaded.named_parameters() if ".lora_" in n) == adapters
    torch.testing.assert_close(logits(loaded), trained, atol=1e-5, rtol=0)
