"""Config loading, overrides and errors that name the field, the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from plait.core.config import load_config, parse_override
from plait.core.engine import check_config
from plait.core.errors import ConfigError, MeshError, PluginError
from plait.core.parallel_dims import resolve_degrees
from plait.core.plugins import Plugins
from plait.tools.cli import app

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_shipped_configs_load() -> None:
    for path in CONFIGS.glob("*.toml"):
        cfg = load_config(path)
        assert cfg.train.steps > 0, path


def test_overrides_parse_literals_and_nest() -> None:
    assert parse_override("train.steps=7") == (["train", "steps"], 7)
    assert parse_override("kernels.prefer=['triton','torch']")[1] == ["triton", "torch"]
    assert parse_override("model.name=gpt2") == (["model", "name"], "gpt2")
    cfg = load_config(CONFIGS / "tiny.toml", ["train.steps=3", "ddp.bucket_mb=0.5"])
    assert cfg.train.steps == 3
    assert cfg.extensions["ddp"]["bucket_mb"] == 0.5


def test_bad_value_names_field_value_and_allowed() -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"train": {"steps": 0}})
    assert "train.steps" in str(err.value) and "got 0" in str(err.value) and "> 0" in str(err.value)


def test_unknown_field_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"train\.stpes"):
        load_config({"train": {"stpes": 3}})


def test_bad_literal_lists_choices() -> None:
    with pytest.raises(ConfigError, match=r"'auto', 'cpu' or 'cuda'"):
        load_config({"train": {"device": "tpu"}})


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_plugin_sections_are_checked(plugins) -> None:
    with pytest.raises(ConfigError, match="unknown config section"):
        check_config(load_config({"dpp": {"bucket_mb": 1}}), plugins, with_model=False)
    with pytest.raises(ConfigError, match=r"ddp\.bucket_mb"):
        check_config(load_config({"ddp": {"bucket_mb": -1}}), plugins, with_model=False)
    with pytest.raises(PluginError, match="'zero7'"):
        check_config(load_config({"parallel": {"dp_strategy": "zero7"}}), plugins, with_model=False)


def test_degrees_must_multiply_to_world_size() -> None:
    assert resolve_degrees(8, dp=-1, tp=2, pp=2, cp=1) == {"pp": 2, "dp": 2, "cp": 1, "tp": 2}
    with pytest.raises(MeshError, match="world size is 4"):
        resolve_degrees(4, dp=2, tp=4, pp=1, cp=1)
    with pytest.raises(MeshError, match="do not divide"):
        resolve_degrees(6, dp=-1, tp=4, pp=1, cp=1)


def test_cli_config_show_and_validate(tmp_path: Path) -> None:
    runner = CliRunner()
    shown = runner.invoke(
        app, ["config", "show", str(CONFIGS / "tiny.toml"), "--set", "train.steps=9"]
    )
    assert shown.exit_code == 0, shown.output
    assert "steps = 9" in shown.output
    # What `config show` prints is itself a valid config.
    round_trip = tmp_path / "shown.toml"
    round_trip.write_text(shown.output)
    assert load_config(round_trip).train.steps == 9

    ok = runner.invoke(app, ["config", "validate", str(CONFIGS / "tiny.toml")])
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(
        app,
        ["config", "validate", str(CONFIGS / "tiny.toml"), "--set", "parallel.dp_strategy=zero7"],
    )
    assert bad.exit_code == 2
    assert "zero7" in bad.output and "ddp" in bad.output


def test_a_misspelt_field_or_section_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"train\.stepz.*did you mean 'steps'\?"):
        load_config({"train": {"stepz": 3}})
    plugins = Plugins.create(autoload=False)
    with pytest.raises(ConfigError, match=r"\['zeor'\]; did you mean 'zero'\?"):
        check_config(load_config({"zeor": {"prefetch": 2}}), plugins, with_model=False)
    with pytest.raises(ConfigError, match=r"zero\.prefech.*did you mean 'prefetch'\?"):
        check_config(load_config({"zero": {"prefech": 2}}), plugins, with_model=False)


def test_version_is_printed() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("plait "), result.output


def test_train_output_and_validation_fields() -> None:
    train = load_config({}).train
    assert (train.log_every, train.eval_every, train.eval_batches) == (10, 0, 2)
    for override, allowed in (
        ("train.eval_fraction=1.5", "< 1"),
        ("train.eval_fraction=0", "> 0"),
        ("train.eval_every=-1", ">= 0"),
        ("train.log_every=0", "> 0"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config({}, [override])
        field = override.split("=")[0]
        assert field in str(err.value) and allowed in str(err.value), (override, str(err.value))


def test_validation_refuses_layouts_that_split_sequences() -> None:
    from types import SimpleNamespace

    from plait.training.validation import check_validation_layout

    config = load_config({}, ["train.eval_every=5", "parallel.pp=2"])
    sizes = {"pp": 2, "cp": 1}
    engine = SimpleNamespace(config=config, mesh=SimpleNamespace(size=lambda a: sizes[a]))
    with pytest.raises(ConfigError, match=r"train.eval_every = 5 .* parallel.pp = 2"):
        check_validation_layout(engine)  # type: ignore[arg-type]
    sizes["pp"] = 1
    check_validation_layout(engine)  # type: ignore[arg-type]
