"""`plait schedule …`: inspect step schedules without running a model.

`plait schedule show --pp 4 --microbatches 8 --schedule 1f1b [--virtual 2] [--png FILE]` asks
the installed plugins for every rank's program (so third-party schedules are shown too), checks
it with the schedule checker, simulates it under uniform per-action costs and prints the
timeline with the simulated and the theoretical bubble fraction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from plait.core.errors import PlaitError
from plait.core.schedule import Action, ScheduleRequest

app = typer.Typer(help="Inspect step schedules (pipeline programs) as data.", no_args_is_help=True)


@app.callback()
def schedule_commands() -> None:
    """Inspect step schedules (pipeline programs) as data."""


def _programs(
    name: str, *, num_stages: int, num_microbatches: int, virtual_stages: int
) -> dict[int, list[Action]]:
    from plait.core.plugins import Plugins

    plugins = Plugins.create()
    if plugins.manager.get_plugin("pipeline") is None:
        # NOTE: until the pipeline plugin is listed in BUILTIN_PLUGINS, make its schedules
        # visible here; once it is, this is a no-op.
        import plait.plugins.pipeline as pipeline_plugin

        plugins.register(pipeline_plugin, "pipeline")
    return {
        stage: plugins.schedule(
            ScheduleRequest(
                name=name,
                num_microbatches=num_microbatches,
                stage=stage,
                num_stages=num_stages,
                virtual_stages=virtual_stages,
            )
        )
        for stage in range(num_stages)
    }


@app.command()
def show(
    pp: Annotated[int, typer.Option("--pp", min=1, help="Pipeline stages (ranks).")] = 4,
    microbatches: Annotated[
        int, typer.Option("--microbatches", min=1, help="Micro-batches per optimizer step.")
    ] = 8,
    schedule: Annotated[
        str, typer.Option("--schedule", help="Schedule name (see `plait plugins`).")
    ] = "1f1b",
    virtual: Annotated[
        int, typer.Option("--virtual", min=1, help="Model chunks per rank (interleaved).")
    ] = 1,
    png: Annotated[
        Path | None, typer.Option("--png", help="Also draw the timeline into this PNG file.")
    ] = None,
) -> None:
    """Print a schedule's per-rank timeline and its simulated and theoretical bubble fraction."""
    from plait.plugins.pipeline.checker import check_schedule
    from plait.plugins.pipeline.timeline import (
        ActionCosts,
        render_png,
        render_text,
        simulate_timeline,
        theoretical_bubble_fraction,
    )

    costs = ActionCosts()
    try:
        programs = _programs(
            schedule, num_stages=pp, num_microbatches=microbatches, virtual_stages=virtual
        )
        check_schedule(
            programs, num_microbatches=microbatches, num_stages=pp, virtual_stages=virtual
        )
        timeline = simulate_timeline(programs, num_stages=pp, virtual_stages=virtual, costs=costs)
    except PlaitError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc

    theory = theoretical_bubble_fraction(
        schedule, num_stages=pp, num_microbatches=microbatches, virtual_stages=virtual, costs=costs
    )
    header = f"{schedule}: pp={pp}, micro-batches={microbatches}"
    if virtual > 1:
        header += f", virtual stages={virtual}"
    typer.echo(
        f"{header}; cost per action F={costs.forward:g} B={costs.backward:g} "
        f"(split: I={costs.backward_input:g} W={costs.backward_weight:g})"
    )
    typer.echo(render_text(timeline))
    typer.echo(f"makespan: {timeline.makespan:g} time units")
    theory_text = f"{theory[0]:.4f} = {theory[1]}" if theory else "not known for this schedule"
    typer.echo(
        f"bubble fraction: simulated {timeline.bubble_fraction:.4f}, theoretical {theory_text}"
    )
    if png is not None:
        title = f"{header} — bubble {timeline.bubble_fraction:.3f} simulated" + (
            f", {theory[0]:.3f} theoretical" if theory else ""
        )
        render_png(timeline, png, title=title)
        typer.echo(f"wrote {png}")
