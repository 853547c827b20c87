"""The `plait` command line: train, config, plugins, demo, init, and the mounted command groups.

Operator commands (daemon, status, top, trace, bottleneck), `plait data`, `plait schedule` and
`plait kernels` live in their own modules and are mounted here. A command group's module
(`plait data`, `plait ckpt`, …) is imported when one of its commands runs or `plait --help`
lists it. Modules listed in `LAZY_MODULES` (those that load gRPC, the daemon or torch at
import) are imported only when one of their commands runs: `plait --help` lists their commands
from their source, read with `ast`. Of a module's commands, only the one that runs is built
(typer builds a command from every parameter's annotations), so `plait top --once --json`, which
an operator polls and a script calls in a loop, pays for its own imports and little else.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import click
import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from plait.core.errors import PlaitError
from plait.training.output import make_console, print_error

if TYPE_CHECKING:
    from plait.core.plugins import Plugins


class _LazyCommands(TyperGroup):
    """The top-level group: the mounted command groups are imported when asked for (listed
    after plait's own, in `MOUNTED_APPS` order), commands of `LAZY_MODULES` when they run;
    while help is formatted those are stand-ins carrying the name and help read from the
    module's source."""

    _listing = False

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = super().list_commands(ctx)
        names += [name for name in _lazy_groups() if name not in names]
        return names + [name for name in _lazy_help() if name not in names]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        if cmd_name in _GROUP_MODULES:
            command = _mounted_group(_GROUP_MODULES[cmd_name], cmd_name)
        else:
            module_name = _lazy_owner(cmd_name)
            if module_name is None:
                return None
            if self._listing:
                return click.Command(cmd_name, help=_module_help(module_name)[cmd_name])
            command = _merged_command(importlib.import_module(module_name).app, cmd_name)
        if command is not None:
            self.add_command(command, cmd_name)
        return command

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    cls=_LazyCommands,
    name="plait",
    help="plait: distributed training for transformer models, built from plugins.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Show or validate a config file.", no_args_is_help=True)
app.add_typer(config_app, name="config")
console = make_console()

# (module, name under `plait`, or None to merge its commands at the top level)
MOUNTED_APPS: tuple[tuple[str, str | None], ...] = (
    ("plait.tools.data_commands", "data"),
    ("plait.tools.schedule_commands", "schedule"),
    ("plait.tools.kernels_commands", "kernels"),
    ("plait.tools.daemon_commands", None),
    ("plait.tools.profile_commands", None),
    ("plait.tools.prometheus_commands", None),
    ("plait.tools.calibrate_commands", None),
    ("plait.tools.ckpt_commands", "ckpt"),
    ("plait.tools.plan_commands", "plan"),
)

# Command modules merged at the top level whose imports are slow (gRPC and the daemon's
# exporters): their commands are listed from their source and imported when one runs.
LAZY_MODULES: tuple[str, ...] = (
    "plait.tools.daemon_commands",
    "plait.tools.profile_commands",
    "plait.tools.prometheus_commands",
)
# {name under `plait`: module} of the mounted command groups, imported when asked for.
_GROUP_MODULES: dict[str, str] = {name: module for module, name in MOUNTED_APPS if name}

Overrides = Annotated[
    list[str] | None,
    typer.Option("--set", help="override a config field: section.field=value (repeatable)"),
]


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"plait {version('plait')}")
        except PackageNotFoundError:
            print("plait (not installed as a distribution)")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version"),
    ] = False,
) -> None:
    """plait: distributed training for transformer models, built from plugins."""


def _fail(exc: Exception) -> None:
    print_error(console, exc)
    raise typer.Exit(2)


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="TOML config file")],
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", help="ranks per node")] = 1,
    nnodes: Annotated[
        str, typer.Option("--nnodes", help="nodes, or MIN:MAX (elastic; Slurm: derived)")
    ] = "",
    node_rank: Annotated[int | None, typer.Option("--node-rank", help="Slurm: derived")] = None,
    rdzv_endpoint: Annotated[
        str,
        typer.Option("--rdzv-endpoint", help="host:port of the rendezvous (Slurm: first node)"),
    ] = "",
    rdzv_id: Annotated[
        str, typer.Option("--rdzv-id", help="job id shared by all nodes (Slurm: the job id)")
    ] = "",
    rdzv_backend: Annotated[
        str, typer.Option("--rdzv-backend", help="c10d, etcd-v2 or static (torchrun's)")
    ] = "c10d",
    rdzv_conf: Annotated[
        str, typer.Option("--rdzv-conf", help="e.g. join_timeout=600,last_call_timeout=30")
    ] = "",
    rdzv_port: Annotated[
        int, typer.Option("--rdzv-port", help="rendezvous port on the first Slurm node")
    ] = 29400,
    local_addr: Annotated[
        str, typer.Option("--local-addr", help="this node's address for the rendezvous")
    ] = "",
    monitor_interval: Annotated[
        float, typer.Option("--monitor-interval", help="seconds between worker health checks")
    ] = 0.1,
    max_restarts: Annotated[
        int, typer.Option("--max-restarts", help="restart the ranks this many times on failure")
    ] = 0,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="print the mesh and per-rank memory estimates; start no rank"
        ),
    ] = False,
    auto: Annotated[
        bool,
        typer.Option("--auto", help="choose the parallel layout with `plait plan`; print it"),
    ] = False,
    allow_quantized_comm: Annotated[
        bool,
        typer.Option(
            "--allow-quantized-comm",
            help="with --auto: the plan may quantize cross-node traffic (ZeRO++ qwZ/qgZ)",
        ),
    ] = False,
    overrides: Overrides = None,
) -> None:
    """Launch training through torch.distributed.run (torchrun)."""
    from plait.core.config import load_config
    from plait.core.engine import check_config
    from plait.core.plugins import Plugins
    from plait.plugins.checkpoint.config import checkpoint_io_config
    from plait.tools.slurm import slurm_launch

    overrides = overrides or []
    try:
        cfg = load_config(config, overrides)
        slurm = slurm_launch(os.environ, rdzv_port=rdzv_port)
        if slurm is not None:
            # Under `srun`, one launcher per node: what is not given comes from the allocation.
            nnodes = nnodes or str(slurm.nnodes)
            node_rank = slurm.node_rank if node_rank is None else node_rank
            rdzv_endpoint = rdzv_endpoint or slurm.rdzv_endpoint
            rdzv_id = rdzv_id or slurm.job_id
            console.print(slurm.describe(), highlight=False, markup=False)
        nnodes = nnodes or "1"
        # An elastic range (MIN:MAX) is checked at its largest size; every rank checks again.
        max_nodes = int(nnodes.rpartition(":")[2])
        if auto:  # the planner's layout, passed to the ranks as overrides
            from plait.planner.auto import auto_overrides

            world = nproc_per_node * max_nodes
            overrides += auto_overrides(
                cfg, world=world, per_node=nproc_per_node, console=console,
                allow_quantized_comm=allow_quantized_comm,
            )  # fmt: skip
            cfg = load_config(config, overrides)
        plugin_manager = Plugins.create(blocked=cfg.plugins.disable)
        check_config(cfg, plugin_manager, world_size=nproc_per_node * max_nodes)
        if dry_run:
            from plait.tools.dry_run import print_dry_run

            print_dry_run(
                cfg,
                plugin_manager,
                world_size=nproc_per_node * max_nodes,
                per_node=nproc_per_node,
                console=console,
            )
            return
    except PlaitError as exc:
        _fail(exc)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    launcher = ["--nproc-per-node", str(nproc_per_node), "--nnodes", nnodes]
    launcher += ["--max-restarts", str(max_restarts), "--monitor-interval", str(monitor_interval)]
    if rdzv_endpoint:
        launcher += ["--rdzv-backend", rdzv_backend, "--rdzv-endpoint", rdzv_endpoint]
        launcher += ["--rdzv-id", rdzv_id or "plait", "--node-rank", str(node_rank or 0)]
        if rdzv_conf:
            launcher += ["--rdzv-conf", rdzv_conf]
        if local_addr:
            launcher += ["--local-addr", local_addr]
    else:
        launcher += ["--standalone"]
    # The job id the ranks report (unless telemetry.job_id is set): the rendezvous id every node
    # shares, else the config's name and the launch time, so two launches never merge in `top`.
    launched = time.strftime("%Y%m%d-%H%M%S")
    job_id = (rdzv_id or "plait") if rdzv_endpoint else (rdzv_id or f"{config.stem}-{launched}")
    os.environ.setdefault("PLAIT_JOB_ID", job_id)
    worker = ["-m", "plait.tools.trainer", str(config)]
    for item in overrides:
        worker += ["--set", item]
    args = get_args_parser().parse_args(launcher + worker)
    # torchrun sets 1 thread per rank and prints a banner about it when this is unset; split
    # the node's cores between its ranks instead (what the banner itself recommends).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from plait.training.launch_errors import LaunchLog, failure_line, launch_log_path

    try:
        with LaunchLog() as launch_log:
            run(args)
    except ChildFailedError as exc:
        # One line with the root cause; torchrun's report and the ranks' tracebacks go to a file.
        line = failure_line(exc, launch_log_path(cfg.train.run_dir), launch_log.lines)
        print_error(console, line, label="training failed:", soft_wrap=True)
        raise typer.Exit(1) from None
    except SignalException as exc:
        # torchrun passed the signal on to the ranks, which finished their step and saved
        # (each printed where); the launcher only reports and exits as the signal asks.
        console.print(
            f"stopped by {exc.sigval.name}: the ranks finished their step"
            + (" and saved a checkpoint" if checkpoint_io_config(cfg).dir else ""),
            highlight=False,
        )
        raise typer.Exit(128 + int(exc.sigval)) from None
    except Exception as exc:  # torchrun's ChildFailedError carries the failing ranks
        print_error(console, exc, label="training failed:")
        raise typer.Exit(1) from None


@app.command("grafana-dashboard")
def grafana_dashboard(
    title: Annotated[str, typer.Option(help="the dashboard's title in Grafana")] = "plait",
) -> None:
    """Print a Grafana dashboard (JSON) over the daemons' Prometheus metrics: `> plait.json`,
    then Grafana → Dashboards → New → Import."""
    from plait.daemon.grafana import dashboard

    print(json.dumps(dashboard(title), indent=2))


@config_app.command("show")
def config_show(
    file: Annotated[Path, typer.Argument(help="TOML config file")],
    overrides: Overrides = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of TOML")] = False,
) -> None:
    """Print the fully resolved config (defaults filled in, overrides applied)."""
    from plait.core.checks import check_config
    from plait.core.config import dump_toml, load_config
    from plait.core.plugins import Plugins

    try:
        cfg = load_config(file, overrides or [])
        plugins = Plugins.create(blocked=cfg.plugins.disable)
        # The checks `plait train` runs before it launches (less the layout, which needs the
        # number of ranks): a config train would refuse is refused here, not shown as valid.
        check_config(cfg, plugins)
    except PlaitError as exc:
        _fail(exc)
    data = cfg.model_dump(mode="json")
    # The sections features declare (`[resilience]`, …) with their defaults filled in, as the
    # core's are: one place shows every value the job runs with.
    for name, (_, record) in plugins.config_sections().items():
        data[name] = cfg.section(name, record.config_cls).model_dump(mode="json")
    print(json.dumps(data, indent=2) if as_json else dump_toml(data), end="")


@config_app.command("validate")
def config_validate(
    file: Annotated[Path, typer.Argument(help="TOML config file")],
    nproc_per_node: Annotated[
        int, typer.Option("--nproc-per-node", help="ranks per node the job will launch")
    ] = 1,
    nnodes: Annotated[int, typer.Option("--nnodes", help="nodes the job will launch")] = 1,
    overrides: Overrides = None,
) -> None:
    """Validate a config against the schema, the installed plugins and, for the ranks given,
    the layout and the model (heads, layers and vocabulary against the degrees)."""
    from plait.core.config import load_config
    from plait.core.engine import check_config
    from plait.core.plugins import Plugins

    try:
        cfg = load_config(file, overrides or [])
        world_size = nproc_per_node * nnodes
        check_config(cfg, Plugins.create(blocked=cfg.plugins.disable), world_size=world_size)
    except PlaitError as exc:
        _fail(exc)
    console.print(
        f"[green]ok[/green]: {escape(str(file))} is valid on {world_size} ranks", highlight=False
    )


@app.command()
def plugins(
    as_json: Annotated[
        bool, typer.Option("--json", help="print a JSON list instead of a table")
    ] = False,
) -> None:
    """List every plugin: its distribution, the hooks it implements, the names it registers."""
    from plait.core.plugins import Plugins

    try:
        manager = Plugins.create()
    except PlaitError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(plugin_listing(manager), indent=2))
        return
    table = Table(title="plait plugins")
    for column in ("plugin", "distribution", "hooks", "provides"):
        table.add_column(column, overflow="fold")
    for info in manager.info():
        hooks = ", ".join(h.removeprefix("plait_") for h in info.hooks)
        cells = (info.name, info.distribution, hooks, ", ".join(info.provides))
        table.add_row(*(Text(cell) for cell in cells))
    console.print(table)


def plugin_listing(manager: Plugins) -> list[dict[str, object]]:
    """`plait plugins --json`: one object per plugin, in registration order.

    `provides` lists what its registration hooks return, each as `{"kind", "name", …}` where
    `kind` is `model`, `schedule`, `comm`, `kernel` or a shard axis (`dp`, `tp`, …); kernels
    add their `provider` and `device_types`, communication algorithms their `ops`.
    """
    provides: dict[str, list[dict[str, object]]] = {}
    for plugin, model in manager.models().values():
        provides.setdefault(plugin, []).append({"kind": "model", "name": model.name})
    for plugin, strategy in manager.strategies().values():
        provides.setdefault(plugin, []).append({"kind": strategy.axis, "name": strategy.name})
    for plugin, schedule in manager.schedules().values():
        provides.setdefault(plugin, []).append({"kind": "schedule", "name": schedule.name})
    for plugin, algorithm in manager.comm_algorithms().values():
        provides.setdefault(plugin, []).append(
            {"kind": "comm", "name": algorithm.name, "ops": list(algorithm.ops)}
        )
    for plugin, kernel in manager.kernel_records():
        provides.setdefault(plugin, []).append(
            {
                "kind": "kernel",
                "name": kernel.op,
                "provider": kernel.provider,
                "device_types": list(kernel.device_types),
            }
        )
    return [
        {
            "name": info.name,
            "distribution": info.distribution,
            "hooks": list(info.hooks),
            "provides": provides.get(info.name, []),
        }
        for info in manager.info()
    ]


@app.command()
def demo(
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node")] = 2,
    steps: Annotated[int, typer.Option("--steps")] = 40,
) -> None:
    """A short multi-rank CPU run with a node daemon: live progress, MFU, bottleneck report."""
    from plait.tools.demo import run_demo

    raise typer.Exit(run_demo(nproc_per_node=nproc_per_node, steps=steps))


@app.command()
def init(
    name: Annotated[
        str, typer.Argument(help="which example: tiny (the default) or demo; see --list")
    ] = "tiny",
    path: Annotated[
        Path | None, typer.Argument(help="file (or folder) to write; default ./NAME.toml")
    ] = None,
    list_names: Annotated[
        bool, typer.Option("--list", help="list the example configs and exit")
    ] = False,
) -> None:
    """Write a starter config to edit, from an example that ships with plait (never
    overwrites a file)."""
    from plait.tools.starter_configs import starter_names, write_starter

    if list_names:
        for choice in starter_names():
            print(choice)
        return
    try:
        written = write_starter(name, path if path is not None else Path(f"{name}.toml"))
    except PlaitError as exc:
        _fail(exc)
    console.print(
        f"wrote {written}; next: plait train {written} --nproc-per-node 2",
        highlight=False,
        markup=False,
    )


def command_help_from_source(module_name: str) -> dict[str, str]:
    """`{command: first help line}` of a module's `@app.command()` functions, read from its
    source without importing it (the name typer gives: the decorator's, else the function's
    with dashes; the help: `help=`, else the docstring's first line). Hidden ones are left out."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        return {}
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    commands: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for decorator in node.decorator_list:
            if not (
                isinstance(decorator, ast.Call)
                and isinstance(decorator.func, ast.Attribute)
                and decorator.func.attr == "command"
            ):
                continue
            options = {k.arg: _literal(k.value) for k in decorator.keywords}
            if options.get("hidden") is True:
                continue
            given = _literal(decorator.args[0]) if decorator.args else options.get("name")
            name = given if isinstance(given, str) else node.name.replace("_", "-")
            text = options.get("help")
            if not isinstance(text, str):
                text = ast.get_docstring(node) or ""
            commands[name] = text.strip().split("\n\n")[0].replace("\n", " ")
    return commands


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


_LAZY_HELP: dict[str, dict[str, str]] = {}  # {module: {command: first help line}}


def _module_help(module_name: str) -> dict[str, str]:
    if module_name not in _LAZY_HELP:
        _LAZY_HELP[module_name] = command_help_from_source(module_name)
    return _LAZY_HELP[module_name]


def _lazy_help() -> dict[str, str]:
    """`{command: first help line}` of every command of `LAZY_MODULES`, in their order."""
    return {name: text for module in LAZY_MODULES for name, text in _module_help(module).items()}


def _lazy_owner(cmd_name: str) -> str | None:
    """The module of `LAZY_MODULES` that holds `cmd_name`: their sources are parsed in turn
    until one has it (parsing one costs more than a small command's own run)."""
    return next((m for m in LAZY_MODULES if cmd_name in _module_help(m)), None)


def _lazy_groups() -> dict[str, str]:
    """`_GROUP_MODULES` less the groups that are not part of this build."""
    return {
        name: module
        for name, module in _GROUP_MODULES.items()
        if importlib.util.find_spec(module) is not None
    }


def _holder() -> typer.Typer:
    """An empty app that builds commands with `app`'s settings, as `app`'s own build does."""
    return typer.Typer(
        rich_markup_mode=app.rich_markup_mode, pretty_exceptions_short=app.pretty_exceptions_short
    )


def _mounted_group(module_name: str, name: str) -> click.Command | None:
    """The module's command group, built as `app.add_typer(module.app, name=name)` mounts it;
    None when the module is not part of this build."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise
    holder = _holder()
    holder.add_typer(module.app, name=name)
    return typer.main.get_group(holder).commands[name]


def _merged_command(sub: typer.Typer, name: str) -> click.Command | None:
    """The command `name` of `sub`, built alone: its siblings are built if they run."""
    holder = _holder()
    holder.registered_commands = [
        info
        for info in sub.registered_commands
        if info.callback is not None
        and (info.name or typer.main.get_command_name(info.callback.__name__)) == name
    ]
    return typer.main.get_group(holder).commands.get(name)


def _mount_apps() -> None:
    for module_name, name in MOUNTED_APPS:
        if name is not None or module_name in LAZY_MODULES:
            continue  # mounted by _LazyCommands when asked for
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # that command group is not part of this build
            raise
        for command in module.app.registered_commands:
            app.registered_commands.append(command)
        for group in module.app.registered_groups:
            app.registered_groups.append(group)


_mount_apps()


def main() -> None:
    try:
        app()
    except PlaitError as exc:
        print_error(console, exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
