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
- `run_distributed`: `plait.testing.run_distributed`, to run a module-level function on
  N Gloo ranks (`fn(rank, world_size, *args)`; FileStore rendezvous, a timeout that names
  the hung ranks).

Helpers (no pytest needed: `plait.testing` imports pytest only when pytest loads it):

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

from plait.testing.distributed import (
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
from plait.testing.managers import plugins_with

# Loaded by pytest with this package (`pytest_plugins = ["plait.testing"]`): the fixtures.
pytest_plugins = ["plait.testing.fixtures"]

__all__ = [
    "TINY_CONFIG",
    "Comparison",
    "PluginSpec",
    "RankFailure",
    "TrainTrace",
    "compare_with_single_process",
    "merged_config",
    "plugins_with",
    "run_distributed",
    "single_process_overrides",
    "train_configs",
]
