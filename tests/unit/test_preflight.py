"""Checks before launch: `plait config validate` and `plait train` refuse a layout that cannot
work, in one message, before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from plait.core.config import load_config
from plait.core.errors import ConfigError
from plait.core.plugins import Plugins
from plait.core.preflight import check_launch
from plait.plugins.models.llama import LlamaConfig
from plait.tools.cli import app

ROOT = Path(__file__).resolve().parents[2]


def _plait(*args: str) -> Result:
    """The CLI in this process (the checks run before any rank would be started)."""
    runner = CliRunner(env={"PLAIT_DISABLE_PLUGIN_AUTOLOAD": "1", "COLUMNS": "200"})
    return runner.invoke(app, [str(ROOT / a) if a.endswith(".toml") else a for a in args])


def test_every_problem_is_listed_in_one_message() -> None:
    config = load_config(
        {"parallel": {"tp": 3}, "data": {"path": "/no/such/dir"}, "train": {"global_batch_size": 5}}
    )
    model = LlamaConfig.from_preset("tiny", {})
    with pytest.raises(ConfigError) as error:
        check_launch(config, world_size=6, model_config=model)
    message = str(error.value)
    assert "does not divide the model's 4 attention heads" in message
    assert "key/value heads" in message and "vocabulary" in message
    assert "data.path = '/no/such/dir' is not a directory" in message
    assert "global_batch_size = 5 is not divisible by dp = 2" in message
    check_launch(load_config({"parallel": {"tp": 2}}), world_size=4, model_config=model)


def test_pipeline_stages_need_layers_and_degrees_need_ranks() -> None:
    model = LlamaConfig.from_preset("tiny", {"n_layers": 2})
    config = load_config({"parallel": {"pp": 2}, "schedule": {"virtual_stages": 2}})
    with pytest.raises(ConfigError, match="needs at least 4 layers; the model has 2"):
        check_launch(config, world_size=2, model_config=model)
    with pytest.raises(ConfigError, match=r"do not divide the world size 2.*--nproc-per-node"):
        check_launch(load_config({"parallel": {"tp": 4}}), world_size=2)
    Plugins.create(autoload=False)  # the checks need no plugin beyond the built-ins


def test_validate_and_train_refuse_before_starting_a_rank() -> None:
    validate = _plait(
        "config", "validate", "configs/tiny.toml", "--nproc-per-node", "2", "--set", "parallel.tp=3"
    )
    assert validate.exit_code == 2, validate.output
    assert "do not divide the world size 2" in validate.stdout
    missing = _plait("config", "validate", "configs/tiny.toml", "--set", "data.path=/no/such/dir")
    assert missing.exit_code == 2 and "is not a directory" in missing.stdout
    train = _plait("train", "configs/tiny.toml", "--nproc-per-node", "2", "--set", "parallel.tp=3")
    assert train.exit_code == 2, train.output
    assert "the job cannot start" in train.stdout
    assert "torch.distributed" not in train.stderr  # nothing was launched
    assert _plait("config", "validate", "configs/tiny.toml", "--nproc-per-node", "2").exit_code == 0
