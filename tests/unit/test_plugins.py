"""The plugin manager: built-ins, entry-point discovery, blocking, and errors that name plugins."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plait.core.checks import check_config
from plait.core.config import Section, load_config
from plait.core.errors import ConfigError, PluginError
from plait.core.hookspecs import hookimpl
from plait.core.plugins import BUILTIN_PLUGINS, Plugins
from plait.core.records import CommAlgorithmRecord, ScheduleRecord, StrategyRecord


def test_builtins_register_and_list_what_they_provide(plugins: Plugins) -> None:
    infos = {info.name: info for info in plugins.info()}
    for name, _ in BUILTIN_PLUGINS:
        assert name in infos, f"built-in {name} missing"
        assert infos[name].distribution == "plait (built-in)"
    assert "dp:ddp" in infos["ddp"].provides
    assert "plait_shard" in infos["ddp"].hooks
    assert "schedule:accumulate" in infos["accumulate"].provides


def test_unknown_strategy_lists_installed_ones(plugins: Plugins) -> None:
    with pytest.raises(PluginError) as err:
        plugins.strategy("dp", "zero9")
    message = str(err.value)
    assert "'zero9'" in message and "'ddp'" in message and "plait (built-in)" in message


def test_unknown_schedule_and_model_name_alternatives(plugins: Plugins) -> None:
    with pytest.raises(PluginError, match="'accumulate'"):
        plugins.schedule_record("nope")
    with pytest.raises(PluginError, match="installed"):
        plugins.model("bert")


class Exploding:
    """A third-party plugin whose registration hook raises."""

    @hookimpl
    def plait_register_strategies(self) -> list[StrategyRecord]:
        raise RuntimeError("boom")


def test_plugin_that_raises_is_named() -> None:
    with pytest.raises(PluginError) as err:
        Plugins.create(autoload=False, extra=[("exploding", Exploding())])
    assert "'exploding'" in str(err.value) and "boom" in str(err.value)


class KeywordOnly:
    @hookimpl
    def plait_register_models(self, *, extra: int = 0) -> list:
        return []


def test_keyword_only_hookimpl_is_rejected_with_advice() -> None:
    with pytest.raises(PluginError, match="remove the `\\*`"):
        Plugins.create(autoload=False, extra=[("kwonly", KeywordOnly())])


class WrongArgument:
    @hookimpl
    def plait_shard(self, axis: str, not_an_argument: int) -> None:
        return None


def test_hookimpl_with_wrong_signature_names_plugin() -> None:
    with pytest.raises(PluginError, match="'wrong'"):
        Plugins.create(autoload=False, extra=[("wrong", WrongArgument())])


class DuplicateDDP:
    @hookimpl
    def plait_register_strategies(self) -> list[StrategyRecord]:
        return [StrategyRecord(name="ddp", axis="dp")]


def test_two_plugins_claiming_one_name_are_both_named() -> None:
    with pytest.raises(PluginError) as err:
        Plugins.create(autoload=False, extra=[("impostor", DuplicateDDP())])
    assert "'ddp'" in str(err.value) and "'impostor'" in str(err.value)


def test_disable_plugins_env_blocks_a_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_DISABLE_PLUGINS", "ddp")
    plugins = Plugins.create(autoload=False)
    assert not plugins.manager.has_plugin("ddp")
    with pytest.raises(PluginError, match="installed for 'dp'"):
        plugins.strategy("dp", "ddp")


PLUGIN_PACKAGE = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "plait-greeting-plugin"
        version = "1.2.3"

        [project.entry-points.plait]
        greeting = "plait_greeting_plugin"
        waving = "plait_greeting_plugin.objects:WAVER"
    """,
    # The module form, with make_plugin() handing out a fresh object per plugin manager.
    "plait_greeting_plugin/__init__.py": """
        from plait.core.hookspecs import hookimpl
        from plait.core.records import StrategyRecord
        from plait.core.sharding import Sharded

        class Greeter:
            def __init__(self):
                self.greeted = 0

            @hookimpl
            def plait_register_strategies(self):
                return [StrategyRecord(name="greeting", axis="ac")]

            @hookimpl
            def plait_shard(self, axis, name, model):
                if name != "greeting":
                    return None
                self.greeted += 1
                model.greeted = True
                return Sharded(module=model)

        def make_plugin():
            return Greeter()
    """,
    # The instance form: the entry point names a plugin object.
    "plait_greeting_plugin/objects.py": """
        from plait.core.hookspecs import hookimpl
        from plait.core.records import StrategyRecord

        class Waver:
            @hookimpl
            def plait_register_strategies(self):
                return [StrategyRecord(name="waving", axis="ac")]

        WAVER = Waver()
    """,
}

DISCOVER = """
import torch
from plait.core.plugins import Plugins
plugins = Plugins.create(autoload=True)
infos = {i.name: i for i in plugins.info()}
info = infos["greeting"]
module = torch.nn.Linear(2, 2)
result = plugins.shard(axis="ac", name="greeting", model=module, context=None)
again = Plugins.create(autoload=True).manager.get_plugin("greeting")
mine = plugins.manager.get_plugin("greeting")
print(info.distribution, "|", ",".join(info.provides), "|", ",".join(info.hooks), "|",
      result.module.greeted, mine.greeted, again.greeted, "|", ",".join(infos["waving"].provides))
"""


@pytest.mark.timeout(240)
def test_separately_installed_distribution_is_discovered(tmp_path: Path) -> None:
    source = tmp_path / "src"
    for rel, text in PLUGIN_PACKAGE.items():
        path = source / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
    )
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", DISCOVER], check=True, capture_output=True, text=True, env=env
    ).stdout.strip()
    # make_plugin() was honoured (the hooks are the object's, and each manager has its own),
    # and an entry point naming an object registers that object.
    assert out == (
        "plait-greeting-plugin 1.2.3 | ac:greeting | plait_register_strategies,plait_shard | "
        "True 1 0 | "
        "ac:waving"
    )


class AllReduceOnly:
    """An algorithm that takes over all-reduces only."""

    @hookimpl
    def plait_register_comm_algorithms(self):  # type: ignore[no-untyped-def]
        return [CommAlgorithmRecord(name="allreduce_only", ops=("all_reduce",))]


class LastFirstOptions(Section):
    rounds: int = 1


class ConfiguredSchedule:
    @hookimpl
    def plait_register_schedules(self):  # type: ignore[no-untyped-def]
        return [ScheduleRecord(name="last_first", config_cls=LastFirstOptions)]


def test_an_algorithm_that_cannot_carry_the_dp_gradients_is_refused() -> None:
    plugins = Plugins.create(autoload=False, extra=[("allreduce_only", AllReduceOnly())])
    ok = load_config({"comm": {"algorithm": "allreduce_only"}, "parallel": {"dp_strategy": "ddp"}})
    check_config(ok, plugins, with_model=False)
    zero2 = load_config(
        {"comm": {"algorithm": "allreduce_only"}, "parallel": {"dp_strategy": "zero2"}}
    )
    with pytest.raises(ConfigError, match=r"'zero2' reduces gradients with .*'reduce_scatter'"):
        check_config(zero2, plugins, with_model=False)


def test_a_schedule_owns_a_validated_config_table() -> None:
    plugins = Plugins.create(autoload=False, extra=[("last_first", ConfiguredSchedule())])
    check_config(load_config({"last_first": {"rounds": 2}}), plugins, with_model=False)
    with pytest.raises(ConfigError, match=r"last_first\.round"):
        check_config(load_config({"last_first": {"round": 2}}), plugins, with_model=False)
