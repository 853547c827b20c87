"""`plait ckpt export --merged`: a LoRA job's adapters merged into its base (W + alpha/r · B·A),
a whole model `AutoModelForCausalLM.from_pretrained` loads with the logits of the LoRA model
plait trained and of peft's own `merge_and_unload()`; the base read from the folder the
checkpoint names or from `--base`, and refused when its hash is not the recorded one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import plait

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 96
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
PEFT = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
CONFIG = {
    "telemetry": {"enabled": False},
    "train": {"device": "cpu", "seed": 3},
    "parallel": {"transforms": {"adapter": "lora"}},
    "peft": PEFT,
}
TOLERANCE = 1e-5


def save_base(folder: Path, seed: int) -> Path:
    """A tiny pretrained Llama, as a model folder (fp32)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def load(folder: Path) -> nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def export(*args: str) -> Any:
    from plait.tools.ckpt_commands import app

    return CliRunner().invoke(app, ["export", *args])


@pytest.fixture
def run(tmp_path: Path) -> dict[str, Any]:
    """A LoRA fine-tune of the base in `base/` (loaded from there, as a user does): the
    checkpoint after 3 steps and the LoRA model's logits then."""
    return fine_tune(tmp_path, CONFIG)


def fine_tune(tmp_path: Path, config: dict[str, Any]) -> dict[str, Any]:
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig

    base = save_base(tmp_path / "base", seed=0)
    engine = plait.initialize(
        load(base).train(), config=config, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    )
    checkpointer = Checkpointer(engine, None, CheckpointIOConfig(dir=str(tmp_path / "ckpt")))
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(step))
        engine.train_step({"input_ids": tokens, "labels": tokens})
    checkpointer.save(3)
    checkpointer.close()
    trained = logits(engine.module.eval())
    engine.close()
    return {"ckpt": tmp_path / "ckpt", "base": base, "logits": trained, "tmp": tmp_path}


def test_merged_model_has_the_lora_models_and_peft_merges_logits(run: dict[str, Any]) -> None:
    tmp = run["tmp"]
    out = export(str(run["ckpt"]), "-o", str(tmp / "merged"), "--merged")
    assert out.exit_code == 0, out.output
    assert "LlamaForCausalLM" in out.output and "merged" in out.output
    assert (tmp / "merged" / "config.json").is_file()
    assert list((tmp / "merged").glob("*.safetensors"))
    merged = load(tmp / "merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    ours = logits(merged)
    torch.testing.assert_close(ours, run["logits"], atol=TOLERANCE, rtol=0)

    # peft's own merge of the same adapters, exported for peft, onto the same base.
    out = export(str(run["ckpt"]), "-o", str(tmp / "adapter"), "--format", "peft")
    assert out.exit_code == 0, out.output
    theirs = peft.PeftModel.from_pretrained(load(run["base"]), tmp / "adapter").merge_and_unload()
    torch.testing.assert_close(ours, logits(theirs), atol=TOLERANCE, rtol=0)
    # The adapters moved the model: a merge that dropped them would equal the base.
    assert (ours - logits(load(run["base"]))).abs().max() > 1e-3


def test_a_module_to_save_exports_and_merges_as_trained(tmp_path: Path) -> None:
    """`modules_to_save = ["lm_head"]`: the head trains in full beside the adapters; `--format
    peft` writes its trained copy under peft's name (peft loads it onto the base with the LoRA
    model's logits) and `--merged` puts it in the base's place, as `merge_and_unload()` does."""
    from safetensors.torch import load_file

    trained = fine_tune(tmp_path, {**CONFIG, "peft": {**PEFT, "modules_to_save": ["lm_head"]}})
    out = export(str(trained["ckpt"]), "-o", str(tmp_path / "adapter"), "--format", "peft")
    assert out.exit_code == 0, out.output
    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.lm_head.weight" in written
    own = peft.get_peft_model(
        load(trained["base"]),
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=PEFT["target_modules"], modules_to_save=["lm_head"]
        ),
    )
    own.save_pretrained(tmp_path / "own")
    assert set(written) == set(load_file(str(tmp_path / "own" / "adapter_model.safetensors")))
    assert peft.PeftConfig.from_pretrained(tmp_path / "adapter").modules_to_save == ["lm_head"]
    loaded = peft.PeftModel.from_pretrained(load(trained["base"]), tmp_path / "adapter")
    torch.testing.assert_close(logits(loaded), trained["logits"], atol=TOLERANCE, rtol=0)

    out = export(str(trained["ckpt"]), "-o", str(tmp_path / "merged"), "--merged")
    assert out.exit_code == 0, out.output
    merged = load(tmp_path / "merged")
    torch.testing.assert_close(logits(merged), trained["logits"], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(logits(merged), logits(loaded.merge_and_unload()))
    # The head moved: a merge that kept the base's would differ from the trained one.
    head = load(trained["base"]).lm_head.weight
    assert (merged.lm_head.weight - head).abs().max() > 1e-3


def test_the_plait_command_merges_with_a_named_base(run: dict[str, Any]) -> None:
    """As a user types it, with the base moved elsewhere and named by --base."""
    tmp = run["tmp"]
    moved = tmp / "elsewhere"
    shutil.move(run["base"], moved)
    script = Path(sys.executable).with_name("plait")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "plait.tools.cli"]
    result = subprocess.run(
        [*command, "ckpt", "export", str(run["ckpt"]), "-o", str(tmp / "merged"),
         "--merged", "--base", str(moved)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "merged into base" in result.stdout
    torch.testing.assert_close(logits(load(tmp / "merged")), run["logits"], atol=TOLERANCE, rtol=0)


def test_a_missing_or_different_base_is_refused_by_name(run: dict[str, Any]) -> None:
    tmp = run["tmp"]
    shutil.move(run["base"], tmp / "elsewhere")
    out = export(str(run["ckpt"]), "-o", str(tmp / "merged"), "--merged")
    assert out.exit_code == 2
    text = "".join(out.output.split())  # the console wraps long lines
    assert "needsthebaseweights" in text and "--base" in text and str(run["base"]) in text

    other = save_base(tmp / "other", seed=1)  # same architecture, other weights
    out = export(str(run["ckpt"]), "-o", str(tmp / "merged"), "--merged", "--base", str(other))
    assert out.exit_code == 2
    text = "".join(out.output.split())
    assert "trainedonbase" in text and str(run["base"]) in text
    assert not (tmp / "merged").exists()

    out = export(str(run["ckpt"]), "-o", str(tmp / "whole"))
    assert out.exit_code == 2 and "--merged" in out.output
    out = export(str(run["ckpt"]), "-o", str(tmp / "x"), "--merged", "--format", "peft")
    assert out.exit_code == 2 and "--format hf" in out.output


def test_the_docs_commands_run_as_written(run: dict[str, Any]) -> None:
    import shlex

    page = (Path(__file__).resolve().parents[2] / "docs" / "fine-tuning.md").read_text()
    lines = [line.split("#")[0] for line in page.splitlines() if "--merged -o" in line or
             "--merged --base" in line]  # fmt: skip
    assert len(lines) == 2
    paths = {"runs/ckpt": run["ckpt"], "./my-base": run["base"]}
    for number, line in enumerate(lines):
        words = [str(paths.get(w, w)) for w in shlex.split(line)]
        assert words[:3] == ["plait", "ckpt", "export"]
        words = [str(run["tmp"] / f"m{number}") if w == "my-model" else w for w in words]
        out = export(*words[3:])
        assert out.exit_code == 0, out.output
        merged = load(run["tmp"] / f"m{number}")
        torch.testing.assert_close(logits(merged), run["logits"], atol=TOLERANCE, rtol=0)


def test_builtin_llama_merges_into_an_hf_llama(tmp_path: Path) -> None:
    """plait's own Llama with adapters on its attention: the base's weights from a plait
    checkpoint, the merged model written as an HF Llama with the job's logits."""
    from plait.core.engine import Engine
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig
    from plait.plugins.checkpoint.offline import write_checkpoint
    from plait.plugins.checkpoint.state import FORMAT
    from plait.plugins.lora.merge import PREFIX

    overrides = {"dim": 32, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 16, "max_seq_len": 32}
    model = {"name": "llama", "size": "tiny", "overrides": overrides}
    engine = Engine(
        config={
            "model": model,
            "data": {"seq_len": 16},
            "train": {"steps": 2, "global_batch_size": 4, "micro_batch_size": 4, "seed": 7,
                      "device": "cpu"},
            "optimizer": {"lr": 3e-2, "warmup_steps": 1},
            "telemetry": {"enabled": False},
            "parallel": {"transforms": {"adapter": "lora"}},
            "peft": {"r": 4, "alpha": 16, "target_modules": ["wq", "wv", "w2"]},
        }
    )  # fmt: skip
    base = {
        name.removeprefix(PREFIX).replace(".base_layer.", "."): p.detach().clone()
        for name, p in engine.module.named_parameters()
        if not p.requires_grad
    }
    write_checkpoint(tmp_path / "base", 0, {
        **{f"model.{k}": v for k, v in base.items()},
        "meta": {"format": FORMAT, "world_size": 1, "degrees": {}, "model": model}})  # fmt: skip
    checkpointer = Checkpointer(engine, None, CheckpointIOConfig(dir=str(tmp_path / "ckpt")))
    generator = torch.Generator().manual_seed(2)
    for _ in range(2):
        tokens = torch.randint(0, 256, (4, 17), generator=generator)
        engine.train_step((tokens[:, :-1], tokens[:, 1:]))
    checkpointer.save(2)
    checkpointer.close()
    with torch.no_grad():
        trained = engine.module.eval()(TOKENS)
    engine.close()

    out = export(str(tmp_path / "ckpt"), "-o", str(tmp_path / "hf"), "--merged")
    assert out.exit_code == 2 and "--base" in out.output and "Llama" in out.output
    out = export(str(tmp_path / "ckpt"), "-o", str(tmp_path / "hf"), "--merged", "--base",
                 str(tmp_path / "base"))  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "HF llama (LlamaForCausalLM)" in out.output
    torch.testing.assert_close(logits(load(tmp_path / "hf")), trained, atol=TOLERANCE, rtol=0)
