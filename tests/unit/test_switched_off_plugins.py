"""A config section may turn a plugin off (`PlaitConfig.plugins_switched_off`):
`telemetry.enabled = false` takes the telemetry plugin out of the engine's manager, so its
wrapper around every comm op never runs; enabled, it stays registered."""

from __future__ import annotations

import pytest

from plait.core.engine import Engine
from plait.core.plugins import Plugins

CONFIG = {
    "model": {"name": "llama", "size": "tiny"},
    "train": {"device": "cpu", "global_batch_size": 1},
}


@pytest.mark.parametrize("enabled", [False, True])
def test_telemetry_is_registered_only_when_enabled(
    enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PLAIT_DAEMON", raising=False)
    config = {**CONFIG, "telemetry": {"enabled": enabled}}
    # Also for a manager the caller built: the section still decides.
    for plugins in (None, Plugins.create()):
        engine = Engine(config=config, plugins=plugins)
        try:
            assert engine.plugins.manager.has_plugin("telemetry") is enabled
        finally:
            engine.close()
