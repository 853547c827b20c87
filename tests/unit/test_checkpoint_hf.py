"""HF safetensors export/import of a tiny Llama: names, config.json, identical logits, RoPE."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from plait.core.kernels import Kernels
from plait.plugins.checkpoint.offline import model_weights, write_checkpoint
from plait.plugins.checkpoint.state import FORMAT
from plait.plugins.models import resolve_model_config
from plait.plugins.models.llama import Llama
from plait.tools.ckpt_commands import app

OVERRIDES = {"dim": 32, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 16, "max_seq_len": 32}


def _llama(plugins, seed: int) -> Llama:
    config = resolve_model_config("llama", "tiny", OVERRIDES)
    model = Llama(config, Kernels(plugins))
    model.init_weights(seed=seed)
    return model


def test_hf_round_trip_gives_identical_logits(plugins, tmp_path: Path) -> None:
    original = _llama(plugins, seed=3)
    state = {f"model.{k}": v.detach() for k, v in original.named_parameters()}
    model_meta = {"name": "llama", "size": "tiny", "overrides": OVERRIDES}
    state["meta"] = {"format": FORMAT, "model": model_meta}
    write_checkpoint(tmp_path / "plait", 5, state)
    runner = CliRunner()

    exported = runner.invoke(app, ["export", str(tmp_path / "plait"), "-o", str(tmp_path / "hf")])
    assert exported.exit_code == 0, exported.output
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.1.self_attn.q_proj.weight" in tensors
    assert "model.layers.0.mlp.gate_proj.weight" in tensors
    assert "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors
    assert len(tensors) == len(list(original.parameters()))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["hidden_size"] == 32
    assert config["intermediate_size"] == original.config.hidden_dim

    imported = runner.invoke(app, ["import", str(tmp_path / "hf"), "-o", str(tmp_path / "back")])
    assert imported.exit_code == 0, imported.output
    weights, meta = model_weights(tmp_path / "back")
    assert meta["model"]["overrides"]["ffn_hidden_dim"] == original.config.hidden_dim
    restored = _llama(plugins, seed=99)
    restored.load_state_dict(weights, strict=True)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(restored(tokens), original(tokens))
        assert not torch.equal(_llama(plugins, seed=99)(tokens), original(tokens))


def test_plait_rope_is_hf_rotate_half(plugins) -> None:
    """HF Llama: q·cos + rotate_half(q)·sin with cos = cat(freqs, freqs); plait's kernel must
    agree, or exported q/k projections would need a permutation."""
    head_dim, seq = 8, 5
    rope = Kernels(plugins).get("rope", torch.device("cpu"), torch.float32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    q = torch.randn(1, seq, 2, head_dim, generator=torch.Generator().manual_seed(1))
    emb = torch.cat((angles, angles), dim=-1).float()[None, :, None, :]
    half = head_dim // 2
    rotate_half = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    hf = q * emb.cos() + rotate_half * emb.sin()
    ours = rope(q, angles.cos().float(), angles.sin().float())
    torch.testing.assert_close(ours, hf)


def test_convert_to_torch_and_back(tmp_path: Path) -> None:
    weight = torch.arange(12.0).view(3, 4)
    write_checkpoint(tmp_path / "a", 2, {"model.w": weight, "train.step": 2})
    runner = CliRunner()
    out = runner.invoke(app, ["convert", str(tmp_path / "a"), "-o", str(tmp_path / "c.pt"),
                              "--to", "torch"])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert torch.equal(torch.load(tmp_path / "c.pt")["model.w"], weight)
    back = runner.invoke(app, ["convert", str(tmp_path / "c.pt"), "-o", str(tmp_path / "b"),
                               "--to", "dcp", "--step", "2"])  # fmt: skip
    assert back.exit_code == 0, back.output
    info = runner.invoke(app, ["info", str(tmp_path / "b")])
    assert info.exit_code == 0 and "1 tensors, 12 parameters" in info.output, info.output
