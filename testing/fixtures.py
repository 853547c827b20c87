"""The pytest fixtures of `plait.testing` (loaded with it): `plait_plugin_under_test`,
`plait_plugins`, `run_distributed`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from plait.core.plugins import Plugins
from plait.testing.distributed import run_distributed
from plait.testing.managers import plugins_with


@pytest.fixture
def plait_plugin_under_test() -> object:
    """Override in your conftest.py: the plugin (or list of plugins) your tests exercise."""
    return None


@pytest.fixture
def plait_plugins(
    plait_plugin_under_test: object, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Plugins]:
    """A fresh plugin manager: built-ins plus your plugin, the `plait` entry points not loaded
    (so other installed packages cannot change the outcome)."""
    # Also for what the test builds itself: an Engine given no `plugins=` makes its own manager.
    monkeypatch.setenv("PLAIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    yield plugins_with(plait_plugin_under_test)


@pytest.fixture(name="run_distributed")
def run_distributed_fixture() -> Callable[..., list[Any]]:
    """`run_distributed(fn, world_size, *args, timeout=..., env=...)` on Gloo ranks (one
    thread each, entry-point autoload off unless `env` turns it back on)."""
    return run_distributed
