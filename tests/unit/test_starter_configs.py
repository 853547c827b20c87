"""`plait init`: the example configs that ship inside the package, copied out to edit."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from plait.core.config import load_config
from plait.tools.cli import app
from plait.tools.starter_configs import starter_names, starter_path, starter_text

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_examples_are_the_repository_configs() -> None:
    assert starter_names() == sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))
    for name in starter_names():
        assert starter_text(name) == (ROOT / "configs" / f"{name}.toml").read_text()
        with starter_path(name) as path:
            assert load_config(path).model.name


def test_init_writes_a_starter_that_validates_and_never_overwrites(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    first = runner.invoke(app, ["init"])
    assert first.exit_code == 0, first.output
    written = tmp_path / "tiny.toml"
    assert "wrote tiny.toml" in first.output and "plait train tiny.toml" in first.output
    text = written.read_text()
    assert text.startswith("# A starter config from `plait init tiny`")
    assert text.endswith(starter_text("tiny"))
    assert load_config(written).train.steps == load_config(ROOT / "configs/tiny.toml").train.steps

    written.write_text("# my edits\n")
    again = runner.invoke(app, ["init"])
    assert again.exit_code == 2
    assert "already exists" in again.output and "not overwriting" in again.output
    assert written.read_text() == "# my edits\n"

    named = runner.invoke(app, ["init", "demo", "runs/my.toml"])
    assert named.exit_code == 0, named.output
    assert load_config(tmp_path / "runs/my.toml").telemetry.job_id == "demo"
    (tmp_path / "into").mkdir()
    assert runner.invoke(app, ["init", "demo", "into"]).exit_code == 0
    assert (tmp_path / "into/demo.toml").is_file()


def test_init_names_the_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    wrong = runner.invoke(app, ["init", "llama70b"])
    assert wrong.exit_code == 2
    assert "no example config named 'llama70b'" in wrong.output
    assert "demo, tiny" in wrong.output
    assert list(tmp_path.iterdir()) == []
    listed = runner.invoke(app, ["init", "--list"])
    assert listed.output.split() == ["demo", "tiny"]
    assert "tiny (the default) or demo" in runner.invoke(app, ["init", "--help"]).output
