"""`plait.testing`: what a plugin package needs in its own pytest suite.

Load it as a pytest plugin from the top-level `conftest.py` of your tests, and name the plugin
under test with the `plait_plugin_under_test` fixture::

    # conftest.py
    pytest_plugins = ["plait.testing"]

    @pytest.fixture
    def plait_plugin_under_test():
        import plait_int8
        return [("int8", plait_int8)]   # or one module / object, or a list of them

Fixtures:

- `plait_plugins`: a fresh `plait.core.plugins.Plugins` per test, entry-point autoload off, the
  built-ins and your plugin registered (modules with `make_plugin()` get a fresh object).
- `run_distributed`: `plait.core.testing.run_distributed`, to run a module-level function on
  N Gloo ranks (`fn(rank, world_size, *args)`; FileStore rendezvous, a timeout that names
  the hung ranks).

Helpers (no pytest needed; also in `plait.core.testing`):

- `compare_with_single_process(config_overrides, world_size=2, steps=4, extra_plugins=[...])`
  trains the tiny built-in Llama under a layout on N ranks and in one process and returns a
  `Comparison` (`.ok`, `.assert_ok()`, printable step-by-step table).
- `train_configs({name: overrides, ...}, world_size=N)` trains several configs in one spawn and
  returns a `TrainTrace` (losses, gradient norms, mesh degrees) per config.

Plugins cross into spawned ranks as module paths (`"plait_int8"` or `("int8", "plait_int8")`),
not objects. Spawned ranks see the parent's `sys.path`, so a plugin importable in the test
process is importable in its ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from plait.core.plugins import Plugins, plugin_object
from plait.core.testing import (
    TINY_CONFIG,
    Comparison,
    PluginSpec,
    RankFailure,
    TrainTrace,
    compare_with_single_process,
    merged_config,
    run_distributed,
    single_process_overrides,
    train_configs,
)

__all__ = [
    "TINY_CONFIG",
    "Comparison",
    "PluginSpec",
    "RankFailure",
    "TrainTrace",
    "compare_with_single_process",
    "merged_config",
    "plait_plugin_under_test",
    "plait_plugins",
    "plugins_with",
    "run_distributed",
    "single_process_overrides",
    "train_configs",
]


def plugins_with(plugin: object = None, *, autoload: bool = False) -> Plugins:
    """A plugin manager with the built-ins and `plugin` registered: a module or object, a
    `(name, plugin)` pair, or a list of either; `None` registers nothing extra."""
    extra: list[tuple[str, object]] = []
    for item in _as_list(plugin):
        name, obj = item if isinstance(item, tuple) else (_name_of(item), item)
        extra.append((name, plugin_object(obj)))
    return Plugins.create(autoload=autoload, extra=extra)


def _as_list(plugin: object) -> list[Any]:
    if plugin is None:
        return []
    return list(plugin) if isinstance(plugin, list) else [plugin]


def _name_of(plugin: object) -> str:
    name = getattr(plugin, "__name__", None) or type(plugin).__name__
    return name.rsplit(".", 1)[-1]


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
