"""Checks of a config against the installed plugins and, given the ranks, the launch.

Run once before any rank starts (`plait config validate`, `plait train`) and again by every
engine: each name a config gives (strategies, schedule, comm algorithm, kernel providers) is
installed, each plugin's table passes its config class, and combinations that would silently do
nothing are refused.
"""

from __future__ import annotations

from pydantic import BaseModel

from plait.core.config import PlaitConfig, did_you_mean
from plait.core.errors import ConfigError, PluginError
from plait.core.plugins import Plugins
from plait.core.preflight import check_launch
from plait.core.records import SHARD_ORDER


def check_config(
    config: PlaitConfig,
    plugins: Plugins,
    *,
    with_model: bool = True,
    world_size: int | None = None,
) -> None:
    """Check the names a config gives against the installed plugins (before any rank starts),
    and, given the number of ranks, the layout against them and the model (`core.preflight`)."""
    sections = _plugin_sections(plugins)
    unknown = sorted(set(config.extensions) - set(sections))
    if unknown:
        known = [*PlaitConfig.model_fields, *sections]
        hints = "".join(did_you_mean(name, known) for name in unknown)
        raise ConfigError(
            f"unknown config section(s) {unknown}{hints}; core sections: "
            f"{sorted(PlaitConfig.model_fields)}; plugin sections: {sorted(sections)}"
        )
    par = config.parallel
    for axis in ("pp", "tp", "cp"):
        if getattr(par, axis) > 1:
            plugins.strategy(axis, getattr(par, f"{axis}_strategy"))
    plugins.strategy("dp", par.dp_strategy)
    for axis, name in par.transform_strategies().items():
        if axis not in SHARD_ORDER:
            raise ConfigError(
                f"parallel.transforms has unknown axis {axis!r}; allowed: {list(SHARD_ORDER)}"
            )
        plugins.strategy(axis, name)
    for section, config_cls in sections.items():
        if config_cls is not None and section in config.extensions:
            config.section(section, config_cls)
    plugins.schedule_record(config.schedule.name)
    _check_comm(config, plugins)
    _check_gradient_collectives(config, plugins)
    _check_kernels(config, plugins)
    model_config = None
    if with_model:
        record = plugins.model(config.model.name)
        if record.make_config is not None:
            model_config = record.make_config(config.model.size, config.model.overrides)
    if world_size is not None:
        check_launch(config, world_size=world_size, model_config=model_config)


def _plugin_sections(plugins: Plugins) -> dict[str, type[BaseModel] | None]:
    """Every config table a plugin owns (strategies, schedules, kernel providers, features),
    by name."""
    sections: dict[str, type[BaseModel] | None] = {}
    for _, record in plugins.config_sections().values():
        sections[record.name] = record.config_cls
    for _, record in plugins.strategies().values():
        sections[record.config_section or record.name] = record.config_cls
    for _, record in plugins.schedules().values():
        if record.config_cls is not None:
            sections[record.config_section or record.name] = record.config_cls
    for _, record in plugins.kernel_records():
        if record.config_cls is not None:
            sections[record.config_section or record.provider] = record.config_cls
    return sections


def _check_gradient_collectives(config: PlaitConfig, plugins: Plugins) -> None:
    """An algorithm that cannot carry a collective the dp strategy reduces gradients with
    would silently leave that traffic alone: refuse the combination instead."""
    algorithm = config.comm.algorithm
    if algorithm == "torch":
        return
    _, record = plugins.comm_algorithms()[algorithm]
    dp = plugins.strategy("dp", config.parallel.dp_strategy)
    missing = [op for op in dp.gradient_collectives if op not in record.ops]
    if missing:
        raise ConfigError(
            f"comm.algorithm = {algorithm!r} takes over {list(record.ops)} but "
            f"parallel.dp_strategy = {dp.name!r} reduces gradients with "
            f"{list(dp.gradient_collectives)}: {missing} would bypass the algorithm; choose a dp "
            "strategy that uses "
            f"{list(record.ops)} only, or an algorithm that also implements {missing}"
        )


def _check_comm(config: PlaitConfig, plugins: Plugins) -> None:
    """`comm.algorithm` names an installed algorithm; each `[comm.<name>]` table belongs to an
    installed algorithm and passes its `config_cls`."""
    algorithms = plugins.comm_algorithms()
    installed = ", ".join(
        ["'torch' (no algorithm)"]
        + [f"{n!r} from {plugins.describe(p)}" for n, (p, _) in sorted(algorithms.items())]
    )
    algorithm = config.comm.algorithm
    if algorithm != "torch" and algorithm not in algorithms:
        raise PluginError(
            f"comm.algorithm = {algorithm!r} is not provided by any installed plugin; "
            f"installed: {installed}"
        )
    for name, table in config.comm.option_tables.items():
        record = algorithms.get(name, (None, None))[1]
        if not isinstance(table, dict) or record is None:
            raise ConfigError(
                f"comm.{name}: not a field of [comm] (fields: algorithm) nor the options table "
                f"of an installed algorithm; installed: {installed}"
            )
        if record.config_cls is None:
            if table:
                raise ConfigError(f"comm.{name}: algorithm {name!r} takes no options")
            continue
        config.comm.options(name, record.config_cls)


def _check_kernels(config: PlaitConfig, plugins: Plugins) -> None:
    """Every provider named in `kernels.prefer` / `kernels.overrides` is registered, and every
    op in `overrides` is one some provider answers."""
    records = [record for _, record in plugins.kernel_records()]
    providers = sorted({r.provider for r in records})
    ops = sorted({r.op for r in records})
    named = [("kernels.prefer", p) for p in config.kernels.prefer] + [
        (f"kernels.overrides.{op}", p) for op, p in config.kernels.overrides.items()
    ]
    for field, provider in named:
        if provider not in providers:
            raise ConfigError(
                f"{field}: no installed plugin provides kernels as {provider!r}; providers: "
                f"{providers}"
            )
    for op in config.kernels.overrides:
        if op not in ops:
            raise ConfigError(f"kernels.overrides: unknown op {op!r}; ops: {ops}")
