"""`plait plugins --json` parses and says who provides what; `plait.testing`'s fixtures work."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from plait.core.hookspecs import hookimpl
from plait.core.records import ScheduleRecord
from plait.core.schedule import Action, Backward, Forward, OptimizerStep, SyncGradients

pytest_plugins = ["plait.testing"]


class OneMicrobatch:
    """A schedule plugin object for the fixture test: one forward, one backward."""

    @hookimpl
    def plait_register_schedules(self) -> Sequence[ScheduleRecord]:
        return [ScheduleRecord(name="one_microbatch")]

    @hookimpl
    def plait_schedule(self, request) -> list[Action] | None:  # type: ignore[no-untyped-def]
        if request.name != "one_microbatch":
            return None
        return [Forward(microbatch=0), Backward(microbatch=0), SyncGradients(), OptimizerStep()]


@pytest.fixture
def plait_plugin_under_test() -> object:
    return ("one_microbatch", OneMicrobatch())


def test_json_listing_parses_and_names_providers(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from plait.tools.cli import app

    monkeypatch.setenv("PLAIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = CliRunner().invoke(app, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    listing = {plugin["name"]: plugin for plugin in json.loads(result.output)}
    assert listing["ddp"]["distribution"] == "plait (built-in)"
    assert listing["ddp"]["hooks"] == ["plait_register_strategies", "plait_shard"]
    assert {"kind": "dp", "name": "ddp"} in listing["ddp"]["provides"]
    assert {"kind": "schedule", "name": "accumulate"} in listing["accumulate"]["provides"]
    rms_norm = next(p for p in listing["kernels_torch"]["provides"] if p["name"] == "rms_norm")
    assert rms_norm == {
        "kind": "kernel",
        "name": "rms_norm",
        "provider": "torch",
        "device_types": ["cpu", "cuda"],
    }
    ring = next(p for p in listing["collectives"]["provides"] if p["name"] == "ring")
    assert ring["kind"] == "comm" and "all_reduce" in ring["ops"]


def test_plait_plugins_fixture_registers_the_plugin_under_test(plait_plugins) -> None:  # type: ignore[no-untyped-def]
    assert "one_microbatch" in plait_plugins.schedules()
    assert "ddp" in {name for _, name in plait_plugins.strategies()}  # built-ins stay
    assert plait_plugins.describe("one_microbatch") == "'one_microbatch' (registered in code)"


def test_single_process_reference_drops_the_layout_only() -> None:
    from plait.testing import single_process_overrides

    layout = {
        "parallel": {"tp": 2, "dp_strategy": "zero3", "transforms": {"ac": "checkpoint"}},
        "schedule": {"name": "reverse_accumulate"},
        "comm": {"algorithm": "int8"},
    }
    assert single_process_overrides(layout) == {
        "parallel": {"transforms": {"ac": "checkpoint"}},
        "schedule": {"name": "reverse_accumulate"},
        "comm": {"algorithm": "int8"},
    }
    assert "schedule" not in single_process_overrides(
        {"parallel": {"pp": 2}, "schedule": {"name": "1f1b"}}
    )
