"""`plait train` of LoRA on the built-in Llama from a pretrained checkpoint, as a user runs it:
the base trained in full, then adapters on 2 ranks with `--set checkpoint_io.init_from=...`,
then the adapters merged into that base by `plait ckpt export --merged`, which checks the base
against the hash the LoRA checkpoint recorded (the job's base record before `init_from` filled
it, the random init's, is refused there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_train_cli import _run  # `plait …` from the checkout, plugins not autoloaded

SMALL = ["--set", "train.steps=2", "--set", "telemetry.enabled=false"]
LORA = [
    "--set",
    "parallel.transforms.adapter=lora",
    "--set",
    'peft.target_modules=["wq", "wv"]',
]


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_lora_trains_from_a_pretrained_checkpoint_and_merges_into_it(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from plait.tools.ckpt_commands import app

    pretrained, lora = tmp_path / "pretrained", tmp_path / "lora"
    base = _run(
        ["train", "configs/tiny.toml", "--nproc-per-node", "1", *SMALL,
         "--set", f"checkpoint_io.dir={pretrained}"],
        timeout=100,
    )  # fmt: skip
    assert base.returncode == 0, base.stdout + base.stderr
    adapted = _run(
        ["train", "configs/tiny.toml", "--nproc-per-node", "2", *SMALL, *LORA,
         "--set", f"checkpoint_io.dir={lora}", "--set", f"checkpoint_io.init_from={pretrained}"],
        timeout=120,
    )  # fmt: skip
    assert adapted.returncode == 0, adapted.stdout + adapted.stderr
    # The recorded hash is the pretrained base's: the merge reads that base and checks it.
    merged = CliRunner().invoke(
        app, ["export", str(lora), "--merged", "--base", str(pretrained), "-o", str(tmp_path / "m")]
    )
    assert merged.exit_code == 0, merged.output
