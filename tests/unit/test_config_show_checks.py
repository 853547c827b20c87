"""`plait config show` refuses what `plait train` refuses, with the same message."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from plait.tools.cli import app

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def test_config_show_refuses_a_misspelt_section_as_train_does() -> None:
    runner = CliRunner()
    misspelt = ["--set", "optimiser.lr=1"]
    shown = runner.invoke(app, ["config", "show", str(CONFIG), *misspelt])
    trained = runner.invoke(app, ["train", str(CONFIG), "--dry-run", *misspelt])
    assert shown.exit_code == trained.exit_code == 2, (shown.output, trained.output)
    assert "[optimiser]" not in shown.output
    assert "did you mean 'optimizer'" in shown.output
    first_line = shown.output.strip().splitlines()[0]
    assert first_line == trained.output.strip().splitlines()[0]


def test_config_show_still_prints_a_valid_config() -> None:
    shown = CliRunner().invoke(app, ["config", "show", str(CONFIG), "--set", "optimizer.lr=1"])
    assert shown.exit_code == 0, shown.output
    assert "[optimizer]" in shown.output and "lr = 1" in shown.output
