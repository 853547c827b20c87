"""Sections a feature declares (`plait_register_config_sections`): `[resilience]` is the
resilience plugin's, its keys written under `[checkpoint_io]` (where they used to live) still
load, and `plait config show` prints it with its defaults beside the core's sections;
`[checkpoint_io]` is the checkpoint plugin's and `[fault_tolerance]` the fault-tolerance
plugin's, shown and refused as the core's sections were."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from plait.core.checks import check_config
from plait.core.config import load_config, read_toml
from plait.core.errors import ConfigError
from plait.core.plugins import Plugins
from plait.plugins.checkpoint.config import CheckpointIOConfig, checkpoint_io_config
from plait.plugins.fault_tolerance.config import FaultToleranceConfig, fault_tolerance_config
from plait.plugins.resilience import ResilienceConfig, resilience_config
from plait.tools.cli import app


def test_the_resilience_section_is_declared_by_its_plugin() -> None:
    sections = Plugins.create().config_sections()
    owner, record = sections["resilience"]
    assert owner == "resilience" and record.config_cls is ResilienceConfig
    assert "section:resilience" in next(
        info.provides for info in Plugins.create().info() if info.name == owner
    )


@pytest.mark.parametrize(
    ("section", "owner", "config_cls"),
    [
        ("checkpoint_io", "checkpoint", CheckpointIOConfig),
        ("fault_tolerance", "fault_tolerance", FaultToleranceConfig),
    ],
)
def test_checkpoint_io_and_fault_tolerance_are_declared_by_their_plugins(
    section: str, owner: str, config_cls: type
) -> None:
    plugins = Plugins.create()
    declared_by, record = plugins.config_sections()[section]
    assert declared_by == owner and record.config_cls is config_cls
    assert f"section:{section}" in next(i.provides for i in plugins.info() if i.name == owner)
    shown = CliRunner().invoke(app, ["plugins"], env={"COLUMNS": "300"})
    assert shown.exit_code == 0 and f"section:{section}" in shown.output, shown.output


def test_config_show_prints_checkpoint_io_and_fault_tolerance_and_loads_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[checkpoint_io]\ndir = "/tmp/ckpt"\n')
    shown = CliRunner().invoke(
        app,
        [
            "config",
            "show",
            str(path),
            "--set",
            "checkpoint_io.every=2",
            "--set",
            "fault_tolerance.replica_groups=2",
        ],
    )
    assert shown.exit_code == 0, shown.output
    again = tmp_path / "shown.toml"
    again.write_text(shown.output)
    data = read_toml(again)
    assert data["checkpoint_io"] == CheckpointIOConfig(dir="/tmp/ckpt", every=2).model_dump()
    assert data["fault_tolerance"] == FaultToleranceConfig(replica_groups=2).model_dump()
    config = load_config(again)
    assert checkpoint_io_config(config) == CheckpointIOConfig(dir="/tmp/ckpt", every=2)
    assert fault_tolerance_config(config).replica_groups == 2
    with pytest.raises(ConfigError, match=r"checkpoint_io\.evry.*did you mean 'every'"):
        check_config(load_config({"checkpoint_io": {"evry": 2}}), Plugins.create())


def test_a_misspelt_key_in_a_declared_section_is_named() -> None:
    config = load_config({"resilience": {"max_consecutive_nonfinit": 2}})
    with pytest.raises(ConfigError, match=r"resilience\.max_consecutive_nonfinit.*did you mean"):
        check_config(config, Plugins.create())


def test_the_old_keys_under_checkpoint_io_still_load_at_their_new_place(
    caplog: pytest.LogCaptureFixture,
) -> None:
    old = {
        "checkpoint_io": {
            "dir": "/tmp/x",
            "max_consecutive_nonfinite": 7,
            "fault_injection": {"kill_after_step": 4, "rank": 1},
        }
    }
    config = load_config(old, ["checkpoint_io.fault_injection.scope=node"])
    section = resilience_config(config)
    assert section.max_consecutive_nonfinite == 7
    assert section.fault_injection.kill_after_step == 4
    assert section.fault_injection.scope == "node"
    assert checkpoint_io_config(config).dir == "/tmp/x"
    assert "checkpoint_io.max_consecutive_nonfinite is now resilience" in caplog.text
    check_config(config, Plugins.create())


def test_an_old_and_a_new_key_both_set_is_an_error_naming_both() -> None:
    both = {
        "checkpoint_io": {"max_consecutive_nonfinite": 1},
        "resilience": {"max_consecutive_nonfinite": 2},
    }
    with pytest.raises(
        ConfigError,
        match=r"checkpoint_io\.max_consecutive_nonfinite and "
        r"resilience\.max_consecutive_nonfinite are both set",
    ):
        load_config(both)


def test_config_show_prints_the_declared_section_with_its_defaults(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("[checkpoint_io]\nmax_consecutive_nonfinite = 5\n")
    shown = CliRunner().invoke(app, ["config", "show", str(path)])
    assert shown.exit_code == 0, shown.output
    again = tmp_path / "shown.toml"
    again.write_text(shown.output)
    data = read_toml(again)
    assert data["resilience"]["max_consecutive_nonfinite"] == 5
    assert data["resilience"]["fault_injection"]["kill_after_step"] == -1
    assert "max_consecutive_nonfinite" not in data["checkpoint_io"]
    # What it prints loads again, to the same values.
    assert resilience_config(load_config(again)).max_consecutive_nonfinite == 5


def test_expert_parallelism_is_asked_for_one_way() -> None:
    """`parallel.ep` is the degree, `parallel.ep_strategy` the strategy ('ep' by default once
    ep > 1; named at ep = 1 it runs with the experts replicated); a file's `transforms.ep`
    loads as `ep_strategy`."""
    assert load_config({"parallel": {"ep": 2}}).parallel.transform_strategies() == {"ep": "ep"}
    assert load_config({}).parallel.transform_strategies() == {}
    at_one = load_config({"parallel": {"ep_strategy": "ep", "transforms": {"ac": "checkpoint"}}})
    assert at_one.parallel.transform_strategies() == {"ac": "checkpoint", "ep": "ep"}
    old = load_config({"parallel": {"ep": 2, "transforms": {"ep": "ep", "ac": "checkpoint"}}})
    assert old.parallel.ep_strategy == "ep" and old.parallel.transforms == {"ac": "checkpoint"}
    with pytest.raises(ConfigError, match=r"parallel.transforms.ep and parallel.ep_strategy"):
        load_config({"parallel": {"ep_strategy": "ep", "transforms": {"ep": "ep"}}})
