"""The plugin manager: built-ins, the `plait` entry-point group, blocking, and a typed facade.

Start-up order (as in DESIGN.md): add hookspecs → register the built-ins from `BUILTIN_PLUGINS`
→ apply blocks (`PLAIT_DISABLE_PLUGINS`, config) → load the `plait` entry-point group unless
`PLAIT_DISABLE_PLUGIN_AUTOLOAD` → `check_pending()` → historic `plait_configure`.

The core never calls `pm.hook.*` directly: it goes through `Plugins`, one typed method per hook
(the way tox's plugin manager does), so that a plugin that raises is reported with its name and
distribution.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import pluggy

from plait.core import hookspecs
from plait.core.errors import InertSelection, PlaitError, PluginError
from plait.core.records import (
    CommAlgorithmRecord,
    ConfigSectionRecord,
    KernelRecord,
    ModelRecord,
    ScheduleRecord,
    StrategyRecord,
)

if TYPE_CHECKING:
    from torch import nn

    from plait.core.comm import Work
    from plait.core.config import PlaitConfig
    from plait.core.document_inputs import ModelInputs
    from plait.core.kernels import KernelChooser
    from plait.core.records import CommRequest
    from plait.core.schedule import Action, ScheduleRequest
    from plait.core.sharding import ShardContext, Sharded
    from plait.core.step import JobInfo, StepReport

ENTRY_POINT_GROUP = "plait"

# Built-ins are registered from this explicit tuple, in this order, under these names.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("torch_comm", "plait.plugins.torch_comm"),
    ("accumulate", "plait.plugins.accumulate"),
    ("kernels_torch", "plait.plugins.kernels_torch"),
    ("kernels_triton", "plait.plugins.kernels_triton"),
    ("kernels_auto", "plait.plugins.kernels_auto"),  # `kernels.provider = "auto"`'s measuring
    ("models", "plait.plugins.models"),
    ("ddp", "plait.plugins.ddp"),
    ("zero", "plait.plugins.zero"),
    ("pipeline", "plait.plugins.pipeline"),
    ("tensor_parallel", "plait.plugins.tensor_parallel"),
    ("context_parallel", "plait.plugins.context_parallel"),
    ("expert_parallel", "plait.plugins.expert_parallel"),
    ("precision", "plait.plugins.precision"),
    ("lora", "plait.plugins.lora"),  # the `adapter` transform and its `[peft]` section
    # How `transformers` models take packed rows (`plait_model_inputs`); the weights' import
    # and export are `plait.plugins.huggingface`'s functions, called by the CLI.
    ("huggingface", "plait.plugins.huggingface.packed_rows"),
    # Activation recomputation, registered under the name `PLAIT_DISABLE_PLUGINS` has always
    # known it by (the saving and loading of checkpoints is `plait.plugins.checkpoint`).
    ("checkpointing", "plait.plugins.activation_checkpointing"),
    ("compile", "plait.plugins.compile"),
    ("collective_timeouts", "plait.plugins.resilience.timeouts"),
    # `[resilience]`: the NaN/Inf guard's and fault injection's section (the training loop
    # attaches both; this registers only the section).
    ("resilience", "plait.plugins.resilience.config"),
    # `[checkpoint_io]`: where and how often the training loop's `Checkpointer` saves.
    ("checkpoint", "plait.plugins.checkpoint.config"),
    # `[fault_tolerance]` and the rank's replica group (`plait_replica_group`); the training
    # loop attaches the replica-group steps themselves.
    ("fault_tolerance", "plait.plugins.fault_tolerance.config"),
    # Spans and metrics of steps and comm ops; the engine unregisters it when
    # `telemetry.enabled` is false, so a run without telemetry pays nothing per op.
    ("telemetry", "plait.plugins.telemetry"),
    # Communication algorithms: inert unless `[comm] algorithm` names one of them.
    ("collectives", "plait.plugins.collectives"),
    ("compression", "plait.plugins.compression"),
    ("param_server", "plait.plugins.param_server"),
)

R = TypeVar("R")


def _disabled_names(config_blocked: Iterable[str] = ()) -> set[str]:
    env = os.environ.get("PLAIT_DISABLE_PLUGINS", "")
    return {n.strip() for n in env.split(",") if n.strip()} | set(config_blocked)


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One registered plugin as `plait plugins` shows it."""

    name: str
    distribution: str
    hooks: tuple[str, ...]
    provides: tuple[str, ...]


class Plugins:
    """Typed facade over a pluggy `PluginManager` for the plait hooks."""

    def __init__(self, manager: pluggy.PluginManager) -> None:
        self.manager = manager
        self._distributions: dict[str, str] = {}  # plugin name -> "dist version" or origin

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        *,
        autoload: bool | None = None,
        blocked: Iterable[str] = (),
        extra: Sequence[tuple[str, object]] = (),
        builtins: Sequence[tuple[str, str]] = BUILTIN_PLUGINS,
    ) -> Plugins:
        """Build a manager in the documented order. `extra` registers (name, plugin) pairs."""
        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        if os.environ.get("PLAIT_TRACE_PLUGINS"):
            manager.trace.root.setwriter(lambda msg: sys.stderr.write(msg))
            manager.enable_tracing()
        for name in _disabled_names(blocked):
            manager.set_blocked(name)
        plugins = cls(manager)
        for name, module_path in builtins:
            if manager.is_blocked(name):
                continue
            plugins._register(plugin_object(importlib.import_module(module_path)), name, "plait")
        for name, plugin in extra:
            if manager.get_plugin(name) is plugin:
                continue  # already registered as a built-in
            plugins._register(plugin, name, "<registered in code>")
        if autoload is None:
            autoload = not os.environ.get("PLAIT_DISABLE_PLUGIN_AUTOLOAD")
        if autoload:
            plugins._load_entry_points()
        try:
            manager.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"plugin {exc.plugin!r} ({plugins.distribution_of(exc.plugin)}) implements a hook "
                f"that plait does not define: {exc}"
            ) from exc
        plugins._check_unique_names()
        return plugins

    def _register(self, plugin: object, name: str, distribution: str) -> None:
        _reject_keyword_only_hookimpls(plugin, name, distribution)
        self._distributions[name] = distribution
        try:
            self.manager.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"plugin {name!r} from {distribution} has an invalid hook implementation: {exc}"
            ) from exc
        except ValueError as exc:
            raise PluginError(f"plugin {name!r} from {distribution}: {exc}") from exc

    def _load_entry_points(self) -> None:
        """Register every `plait` entry point exactly as a built-in: a module (or object) with
        `make_plugin()` hands out a fresh plugin per manager, anything else is the plugin."""
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            name = entry_point.name
            if self.manager.is_blocked(name) or self.manager.has_plugin(name):
                continue
            dist = entry_point.dist
            where = f"{dist.name} {dist.version}" if dist is not None else entry_point.value
            try:
                plugin = plugin_object(entry_point.load())
            except Exception as exc:
                raise PluginError(
                    f"plugin {name!r} ({where}) from the {ENTRY_POINT_GROUP!r} entry-point group "
                    f"failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            self._register(plugin, name, where)

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object at run time (tests, user code)."""
        self._register(plugin, name or getattr(plugin, "__name__", repr(plugin)), "<code>")

    def switch_off(self, names: Sequence[str]) -> None:
        """Unregister the plugins `names` that are registered (a config section turned them
        off: `PlaitConfig.plugins_switched_off`)."""
        for name in names:
            if self.manager.has_plugin(name):
                self.manager.unregister(name=name)

    def configure(self, config: PlaitConfig) -> None:
        try:
            self.manager.hook.plait_configure.call_historic(kwargs={"config": config})
        except PlaitError:
            raise
        except Exception as exc:
            culprit = _plugin_in_traceback(exc, self.manager)
            where = self.describe(culprit) if culprit else "a plugin"
            raise PluginError(
                f"{where} raised {type(exc).__name__} in plait_configure: {exc}"
            ) from exc

    # -- naming plugins in errors -------------------------------------------------------------

    def distribution_of(self, plugin: object) -> str:
        name = self.manager.get_name(plugin) if plugin is not None else None
        if name and any(name == builtin for builtin, _ in BUILTIN_PLUGINS):
            return "plait (built-in)"
        origin = self._distributions.get(name or "")
        if origin and not origin.startswith("<"):
            return origin
        return "registered in code"

    def describe(self, plugin_name: str) -> str:
        plugin = self.manager.get_plugin(plugin_name)
        return f"{plugin_name!r} ({self.distribution_of(plugin)})"

    def _call(self, hook_name: str, **kwargs: Any) -> Any:
        hook = getattr(self.manager.hook, hook_name)
        try:
            return hook(**kwargs)
        except PlaitError:
            raise  # a user-level error (bad config, bad schedule) is reported as it is
        except Exception as exc:
            culprit = _plugin_in_traceback(exc, self.manager)
            where = self.describe(culprit) if culprit else "a plugin"
            raise PluginError(f"{where} raised {type(exc).__name__} in {hook_name}: {exc}") from exc

    def _collect(self, hook_name: str) -> list[tuple[str, Any]]:
        """Call a registration hook plugin by plugin, keeping who returned what."""
        results: list[tuple[str, Any]] = []
        for impl in getattr(self.manager.hook, hook_name).get_hookimpls():
            try:
                records = impl.function()
            except Exception as exc:
                raise PluginError(
                    f"{self.describe(impl.plugin_name)} raised {type(exc).__name__} in "
                    f"{hook_name}: {exc}"
                ) from exc
            results.extend((impl.plugin_name, r) for r in records or ())
        return results

    def _check_unique_names(self) -> None:
        for hook_name, key in (
            ("plait_register_models", lambda r: r.name),
            ("plait_register_strategies", lambda r: (r.axis, r.name)),
            ("plait_register_schedules", lambda r: r.name),
            ("plait_register_comm_algorithms", lambda r: r.name),
            ("plait_register_kernels", lambda r: (r.op, r.provider)),
            ("plait_register_config_sections", lambda r: r.name),
        ):
            seen: dict[Any, str] = {}
            for plugin_name, record in self._collect(hook_name):
                k = key(record)
                if k in seen and seen[k] != plugin_name:
                    raise PluginError(
                        f"{self.describe(seen[k])} and {self.describe(plugin_name)} both "
                        f"register {k!r} in {hook_name}"
                    )
                seen[k] = plugin_name

    # -- registration records -----------------------------------------------------------------

    def models(self) -> dict[str, tuple[str, ModelRecord]]:
        return {r.name: (p, r) for p, r in self._collect("plait_register_models")}

    def strategies(self) -> dict[tuple[str, str], tuple[str, StrategyRecord]]:
        return {(r.axis, r.name): (p, r) for p, r in self._collect("plait_register_strategies")}

    def schedules(self) -> dict[str, tuple[str, ScheduleRecord]]:
        return {r.name: (p, r) for p, r in self._collect("plait_register_schedules")}

    def kernel_records(self) -> list[tuple[str, KernelRecord]]:
        return self._collect("plait_register_kernels")

    def config_sections(self) -> dict[str, tuple[str, ConfigSectionRecord]]:
        return {r.name: (p, r) for p, r in self._collect("plait_register_config_sections")}

    def comm_algorithms(self) -> dict[str, tuple[str, CommAlgorithmRecord]]:
        return {r.name: (p, r) for p, r in self._collect("plait_register_comm_algorithms")}

    def model(self, name: str) -> ModelRecord:
        models = self.models()
        if name not in models:
            raise PluginError(
                f"model {name!r} is not provided by any installed plugin; installed: "
                + _listing({n: p for n, (p, _) in models.items()}, self)
            )
        return models[name][1]

    def strategy(self, axis: str, name: str) -> StrategyRecord:
        strategies = self.strategies()
        if (axis, name) not in strategies:
            installed = {n: p for (a, n), (p, _) in strategies.items() if a == axis}
            raise PluginError(
                f"no installed plugin provides strategy {name!r} for the {axis!r} axis; "
                f"installed for {axis!r}: {_listing(installed, self)}"
            )
        return strategies[(axis, name)][1]

    def schedule_record(self, name: str) -> ScheduleRecord:
        schedules = self.schedules()
        if name not in schedules:
            raise PluginError(
                f"schedule {name!r} is not provided by any installed plugin; installed: "
                + _listing({n: p for n, (p, _) in schedules.items()}, self)
            )
        return schedules[name][1]

    # -- decision hooks -----------------------------------------------------------------------

    def shard(self, *, axis: str, name: str, model: nn.Module, context: ShardContext) -> Sharded:
        owner = self.strategies().get((axis, name), (None,))[0]
        self.strategy(axis, name)  # raises with the installed alternatives
        result = self._call("plait_shard", axis=axis, name=name, model=model, context=context)
        if result is None:
            raise PluginError(
                f"{self.describe(owner)} registers strategy {name!r} for axis {axis!r} but its "
                "plait_shard returned None for it"
            )
        return result

    def communicate(self, request: CommRequest) -> Work:
        result = self._call("plait_communicate", request=request)
        if result is None:
            raise PluginError(f"no plugin carried out communication op {request.op!r}")
        return result

    def schedule(self, request: ScheduleRequest) -> list[Action]:
        record = self.schedule_record(request.name)
        actions = self._call("plait_schedule", request=request)
        if actions is None:
            owner = self.schedules()[record.name][0]
            raise InertSelection(
                f"schedule.name = {record.name!r} selects {self.describe(owner)}, but its "
                f"plait_schedule answered nothing when offered {request}."
            )
        return list(actions)

    def kernel(
        self, *, name: str, device: str, dtype: str, provider: str | None = None
    ) -> Callable[..., Any] | None:
        return self._call("plait_kernel", name=name, device=device, dtype=dtype, provider=provider)

    def kernel_chooser(self) -> KernelChooser | None:
        """What picks kernel providers by measurement (`plait_kernel_chooser`), or None."""
        return self._call("plait_kernel_chooser", plugins=self)

    def model_inputs(self, model: nn.Module) -> ModelInputs | None:
        """How a plugin says `model` takes packed rows (`plait_model_inputs`), or None."""
        return self._call("plait_model_inputs", model=model)

    def replica_group(self, config: PlaitConfig) -> int:
        """The rank's replica group a plugin names (`plait_replica_group`), else -1."""
        group = self._call("plait_replica_group", config=config)
        return -1 if group is None else int(group)

    def job_start(self, info: JobInfo) -> None:
        self._call("plait_job_start", info=info)

    def job_end(self) -> None:
        self._call("plait_job_end")

    def step_start(self, step: int) -> None:
        self._call("plait_step_start", step=step)

    def step_end(self, report: StepReport) -> None:
        self._call("plait_step_end", report=report)

    def checkpoint_state(self, rank: int) -> list[dict[str, Any]]:
        return self._call("plait_checkpoint_state", rank=rank)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self._call("plait_load_checkpoint_state", state=state)

    # -- listing --------------------------------------------------------------------------------

    def info(self) -> list[PluginInfo]:
        provides: dict[str, list[str]] = {}
        for hook_name, fmt in (
            ("plait_register_models", lambda r: f"model:{r.name}"),
            ("plait_register_strategies", lambda r: f"{r.axis}:{r.name}"),
            ("plait_register_schedules", lambda r: f"schedule:{r.name}"),
            ("plait_register_comm_algorithms", lambda r: f"comm:{r.name}"),
            ("plait_register_kernels", lambda r: f"kernel:{r.op}@{r.provider}"),
            ("plait_register_config_sections", lambda r: f"section:{r.name}"),
        ):
            for plugin_name, record in self._collect(hook_name):
                provides.setdefault(plugin_name, []).append(fmt(record))
        infos = []
        for name, plugin in self.manager.list_name_plugin():
            if plugin is None:
                continue
            hooks = tuple(sorted(h.name for h in self.manager.get_hookcallers(plugin) or ()))
            infos.append(
                PluginInfo(
                    name=name,
                    distribution=self.distribution_of(plugin),
                    hooks=hooks,
                    provides=tuple(provides.get(name, ())),
                )
            )
        return infos


def plugin_object(loaded: object) -> object:
    """The plugin a module or entry point stands for: `make_plugin()` when it defines one (a
    fresh object per manager, so per-engine state is not shared), else the object itself."""
    factory = getattr(loaded, "make_plugin", None)
    return factory() if callable(factory) else loaded


def _reject_keyword_only_hookimpls(plugin: object, name: str, distribution: str) -> None:
    """pluggy passes hook arguments to ordinary parameters; a `*` would make the call fail later."""
    for attr in dir(plugin):
        if not attr.startswith("plait_"):
            continue
        function = getattr(plugin, attr, None)
        if not callable(function):
            continue
        kwonly = [
            p.name
            for p in inspect.signature(function).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        if kwonly:
            raise PluginError(
                f"plugin {name!r} from {distribution}: hook implementation {attr} declares "
                f"keyword-only parameters {kwonly}; pluggy calls hooks by keyword but passes "
                "values to ordinary parameters, so remove the `*`"
            )


def _listing(names_to_plugins: dict[str, str], plugins: Plugins) -> str:
    if not names_to_plugins:
        return "(none)"
    return ", ".join(
        f"{n!r} from {plugins.describe(p)}" for n, p in sorted(names_to_plugins.items())
    )


def _plugin_in_traceback(exc: BaseException, manager: pluggy.PluginManager) -> str | None:
    """Find the innermost registered plugin whose code appears in the exception's traceback."""
    modules = {
        getattr(plugin, "__name__", None) or type(plugin).__module__: name
        for name, plugin in manager.list_name_plugin()
        if plugin is not None
    }
    culprit = None
    tb = exc.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        for prefix, name in modules.items():
            if prefix and (module == prefix or module.startswith(prefix + ".")):
                culprit = name
        tb = tb.tb_next
    return culprit
