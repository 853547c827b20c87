"""HF safetensors through the CLI and running jobs: names, config.json, equal logits, RoPE.

The per-family round trips through transformers are in `test_hf_families.py`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from plait.core.kernels import Kernels
from plait.plugins.checkpoint.offline import model_weights, write_checkpoint
from plait.plugins.checkpoint.state import FORMAT
from plait.plugins.huggingface.weights import export_hf_from, load_hf_into
from plait.plugins.models import resolve_model_config
from plait.plugins.models.llama import Llama
from plait.tools.ckpt_commands import app

OVERRIDES = {"dim": 32, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 16, "max_seq_len": 32}
HIDDEN = 96  # the SwiGLU width Meta's rule gives OVERRIDES
_QWEN2 = dict(vocab_size=256, hidden_size=32, intermediate_size=HIDDEN,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=32, rms_norm_eps=1e-5)  # fmt: skip
_GPT2 = dict(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=32)


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
    assert info.exit_code == 0 and "1 tensor · 12 parameters" in info.output, info.output
    assert "{" not in info.output and "step       2" in info.output, info.output  # no reprs


def _engine(model: dict[str, Any]) -> Any:
    from plait.core.engine import Engine

    return Engine(
        config={
            "model": {"size": "tiny", **model},
            "data": {"seq_len": 16},
            "train": {"steps": 2, "global_batch_size": 4, "micro_batch_size": 2, "seed": 7,
                      "device": "cpu"},
            "optimizer": {"lr": 3e-2, "warmup_steps": 1},
            "telemetry": {"enabled": False},
        }
    )  # fmt: skip


def _hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits


def _logits(engine: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return engine.module(tokens)


GPT2_MODEL = {"name": "gpt2", "overrides": {"dim": 32, "n_heads": 4, "max_seq_len": 32}}
TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def test_cli_exports_a_trained_gpt2_checkpoint_that_transformers_loads(tmp_path: Path) -> None:
    """`plait ckpt export --format hf` on what the engine's checkpointer wrote after training;
    `plait ckpt import` of that folder gives the same weights back."""
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig
    from plait.plugins.data import build_batches

    engine = _engine(GPT2_MODEL)
    batches = build_batches(engine.config.data, seq_len=16, global_batch_size=4, dp_rank=0,
                            dp_size=1, seed=7)  # fmt: skip
    checkpointer = Checkpointer(engine, batches, CheckpointIOConfig(dir=str(tmp_path / "ckpt")))
    for _ in range(2):
        engine.train_step(batches.next_batch())
    checkpointer.save(2)
    checkpointer.close()
    trained = _logits(engine, TOKENS)
    engine.close()
    runner = CliRunner()

    out = runner.invoke(app, ["export", str(tmp_path / "ckpt"), "--format", "hf",
                              "-o", str(tmp_path / "hf")])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "HF gpt2 (GPT2LMHeadModel)" in out.output
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", TOKENS), trained, atol=1e-5, rtol=0)

    back = runner.invoke(app, ["import", str(tmp_path / "hf"), "-o", str(tmp_path / "back")])
    assert back.exit_code == 0, back.output
    assert "--set model.name=gpt2" in back.output
    weights, meta = model_weights(tmp_path / "back")
    saved, _ = model_weights(tmp_path / "ckpt")
    assert meta["model"]["name"] == "gpt2"
    assert weights.keys() == saved.keys()
    assert all(torch.equal(weights[k], saved[k]) for k in saved)


def test_running_jobs_export_and_load_qwen2_and_gpt2(tmp_path: Path) -> None:
    """`export_hf_from` writes a Qwen2 for a llama job with q/k/v biases; `load_hf_into` fills a
    job from folders transformers saved (tied Qwen2: the output comes from the embedding;
    GPT-2: transposed, fused c_attn)."""
    transformers = pytest.importorskip("transformers")
    qwen = _engine({"name": "llama", "overrides": {**OVERRIDES, "qkv_bias": True}})
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in qwen.module.parameters():  # biases start at zero: make them count
            param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    export_hf_from(qwen, tmp_path / "exported")
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_key_value_heads"] == 2
    torch.testing.assert_close(
        _hf_logits(tmp_path / "exported", TOKENS), _logits(qwen, TOKENS), atol=1e-5, rtol=0
    )

    for engine, hf_config in (
        (qwen, transformers.Qwen2Config(**_QWEN2, tie_word_embeddings=True)),
        (_engine(GPT2_MODEL), transformers.GPT2Config(**_GPT2)),
    ):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
        with torch.no_grad():
            for param in hf_model.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            expected = hf_model(TOKENS).logits
        folder = tmp_path / hf_config.model_type
        hf_model.save_pretrained(folder)
        assert load_hf_into(engine, folder) == len(list(engine.module.parameters()))
        torch.testing.assert_close(_logits(engine, TOKENS), expected, atol=1e-5, rtol=0)
        engine.close()
