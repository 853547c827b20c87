"""`plait kernels`: which provider answers each kernel op on each device type, for a config.

Resolution is exactly the runtime's: the plugin manager is built the way a rank builds it
(built-ins, the `plait` entry-point group, `plugins.disable`), then `plait.core.kernels.Kernels`
walks the config's `kernels.prefer` and `kernels.overrides` for every op in `KERNEL_OPS`. A cell
that cannot be resolved (an override naming a provider that does not answer) shows the error.
An op chosen by measurement (`kernels.provider = "auto"`) shows `auto`; what the runs on this
host measured — per op and shape the chosen provider, every provider's time and the providers
skipped with their reasons — is read from the choices file and listed below the table.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from plait.core.errors import PlaitError
from plait.training.output import make_console, print_error

if TYPE_CHECKING:
    from plait.plugins.kernels_auto.selection import ChoiceStore

app = typer.Typer(
    name="kernels",
    help="Show which implementation answers each kernel op on each device.",
    # A command group stops parsing its own options at the first positional argument; the
    # listing has no subcommands, so let `--set` follow the config path as in `plait train`.
    context_settings={"allow_interspersed_args": True},
)
console = make_console()

DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def resolve_providers(
    config_path: Path | None = None,
    overrides: list[str] | None = None,
    *,
    dtype: str = "float32",
    device_types: tuple[str, ...] = DEVICE_TYPES,
) -> tuple[dict[str, dict[str, str]], dict[str, list[str]], list[str]]:
    """Return (op -> device -> provider or "error: …", op -> installed providers, prefer).

    The provider strings are what `Kernels.provider_of` reports for the config's selection.
    """
    from plait.core.config import load_config
    from plait.core.kernels import KERNEL_OPS, Kernels
    from plait.core.plugins import Plugins

    config = load_config(config_path, overrides or ())
    plugins = Plugins.create(blocked=config.plugins.disable)
    if plugins.manager.get_plugin("kernels_triton") is None and not plugins.manager.is_blocked(
        "kernels_triton"
    ):
        # NOTE: until kernels_triton is listed in BUILTIN_PLUGINS, make it visible here the
        # way a rank would see it; once it is, this is a no-op.
        import plait.plugins.kernels_triton as kernels_triton

        plugins.register(kernels_triton, "kernels_triton")
    kernels = Kernels(
        plugins,
        prefer=config.kernels.prefer,
        overrides=config.kernels.overrides,
        provider=config.kernels.provider,
    )
    chosen: dict[str, dict[str, str]] = {}
    installed: dict[str, list[str]] = {}
    for op in KERNEL_OPS:
        chosen[op] = {}
        for device in device_types:
            try:
                chosen[op][device] = kernels.provider_of(op, device, dtype)
            except PlaitError as exc:
                chosen[op][device] = f"error: {exc}"
        installed[op] = kernels.providers_for(op)
    return chosen, installed, list(config.kernels.prefer)


def compiled_forms(blocked: list[str] | None = None) -> dict[tuple[str, str], str]:
    """(op, provider) -> how the provider's op sits in a compiled block ("custom op", "traced",
    "graph break"), as its `KernelRecord` says."""
    from plait.core.plugins import Plugins

    plugins = Plugins.create(blocked=blocked or [])
    return {
        (record.op, record.provider): record.compiled_form
        for _, record in plugins.kernel_records()
        if record.compiled_form
    }


@app.callback(invoke_without_command=True)
def kernels_table(
    config: Annotated[
        Path | None, typer.Argument(help="Config TOML whose kernels section is used.")
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a config field: section.field=value (repeatable)."),
    ] = None,
    dtype: Annotated[
        str, typer.Option("--dtype", help=f"Activation dtype to resolve for: {', '.join(DTYPES)}.")
    ] = "float32",
) -> None:
    """List, per op and device type, the provider the config's kernel selection resolves to."""
    if dtype not in DTYPES:
        print_error(console, f"--dtype {dtype!r}; allowed: {', '.join(DTYPES)}", highlight=True)
        raise typer.Exit(2)
    try:
        chosen, installed, prefer = resolve_providers(config, overrides, dtype=dtype)
    except PlaitError as exc:
        print_error(console, exc)
        raise typer.Exit(2) from None
    forms = compiled_forms()
    # Provider names come from plugins and `prefer` from the config: shown as they are.
    table = Table(title=f"kernel providers for {dtype} (prefer = {escape(str(prefer))})")
    table.add_column("op", style="bold", no_wrap=True)
    for device in DEVICE_TYPES:
        table.add_column(device)
    table.add_column("installed providers (device types)", style="dim")
    errors: list[str] = []
    for op, by_device in chosen.items():
        cells: list[str | Text] = []
        for device, provider in by_device.items():
            if provider.startswith("error:"):
                errors.append(f"{op} on {device}: {provider.removeprefix('error: ')}")
                cells.append(f"[red]unresolved ({len(errors)})[/red]")
            else:
                form = forms.get((op, provider))
                cells.append(Text(f"{provider} · {form}" if form else provider))
        table.add_row(op, *cells, Text("; ".join(installed[op]) or "(none)"))
    console.print(table)
    for number, error in enumerate(errors, start=1):
        print_error(console, error, label=f"({number})")
    print_measured_choices()
    console.print(
        "[dim]· how the op sits in a torch.compile'd block: a custom op is one node the compiler "
        "fuses around, traced code is fused into the graph, a graph break runs eagerly.[/dim]"
    )
    console.print(
        "[dim]Triton answers CPU only under TRITON_INTERPRET=1 and only when asked by name "
        "(kernels.prefer or kernels.overrides); the interpreter checks correctness, not "
        "speed.[/dim]"
    )


def _format_seconds(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def print_measured_choices(store: ChoiceStore | None = None) -> None:
    """The choices `kernels.provider = "auto"` measured on this host, one table per machine key
    (hardware, driver and library versions: a run under other versions measures again)."""
    from plait.plugins.kernels_auto.selection import default_store

    store = store or default_store()
    by_machine = store.choices()
    if not by_machine:
        console.print(
            f"[dim]no measured kernel choices in {escape(str(store.path))}[/dim]", highlight=False
        )
        return
    for machine, choices in sorted(by_machine.items()):
        table = Table(title=f"measured kernel choices: {escape(machine)}", title_justify="left")
        table.add_column("op", style="bold", no_wrap=True)
        table.add_column("device/dtype", no_wrap=True)
        table.add_column("first-call shapes")
        table.add_column("chosen", style="green")
        table.add_column("timed (median per run)")
        table.add_column("skipped (why)", style="yellow")
        for choice in sorted(choices, key=lambda c: (c.op, c.device, c.dtype, c.shapes)):
            timings = ", ".join(
                f"{provider} {_format_seconds(seconds)}"
                for provider, seconds in sorted(choice.timings.items(), key=lambda t: t[1])
            )
            skipped = "; ".join(f"{provider}: {why}" for provider, why in choice.skipped.items())
            cells = (
                choice.op, f"{choice.device}/{choice.dtype}", choice.shapes, choice.provider,
                f"{choice.timed}: {timings}", skipped or "-",
            )  # fmt: skip
            table.add_row(*(Text(cell) for cell in cells))
        console.print(table)
    console.print(f"[dim]from {escape(str(store.path))}[/dim]", highlight=False)
