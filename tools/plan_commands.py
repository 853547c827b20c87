"""`plait plan`: choose a parallel layout; `plait plan calibrate` / `plait plan explain` feed it
the daemon's measurements and compare a finished run with the prediction.

    plait plan llama:70b --world 64 --per-node 8 --device H100-80GB --global-batch 512
    plait plan llama:70b --world 64 --per-node 8 --global-batch 512 --allow-quantized-comm
    plait plan calibrate --host node0:50051          # fit the links to recorded comm spans
    plait plan explain --host node0:50051 --config run.toml --world 8 --device H100-80GB

`plait plan MODEL …` is `plait plan search MODEL …`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from plait.core.errors import PlaitError
from plait.training.output import make_console, print_error


class _DefaultSearch(TyperGroup):
    """`plait plan MODEL …` runs `search`: a first argument that names no subcommand is a model."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["search", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=_DefaultSearch,
    help="Choose a parallel layout from a cost model calibrated by the daemon's measurements.",
    no_args_is_help=True,
)
console = make_console()

Device = Annotated[str, typer.Option(help="device: H100-80GB, A100-80GB, A100-40GB, H200-141GB")]
Links = Annotated[
    Path | None,
    typer.Option(help="fitted links from `plait plan calibrate` (default: its cache file)"),
]


def _fail(exc: Exception) -> None:
    print_error(console, exc)
    raise typer.Exit(2)


def _int_list(text: str, field: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise PlaitError(f"{field}: expected comma-separated integers, got {text!r}") from None


def _device(name: str, links: Path | None) -> Any:
    from plait.planner.comm_model import LinkCalibration, default_calibration_path
    from plait.planner.devices import device_spec, with_links

    device = device_spec(name)
    path = links or default_calibration_path()
    if path.is_file():
        calibration = LinkCalibration.load(path)
        device = with_links(
            device,
            intra=calibration.intra.link() if calibration.intra else None,
            inter=calibration.inter.link() if calibration.inter else None,
        )
        console.print(f"links from {path} ({calibration.source})", highlight=False, markup=False)
    elif links is not None:
        raise PlaitError(f"--links: {links} does not exist")
    return device


def render_plan(result: Any, *, top: int) -> Table:
    """The ranked layouts: memory, step time, MFU, and the data-parallel traffic that crosses
    nodes in one step (bytes summed over the ranks; seconds the busiest rank sends them)."""
    from plait.planner.search import why_slower

    best = result.ranked[0]
    table = Table(
        title=f"best {min(top, len(result.ranked))} of {len(result.ranked)} fitting meshes"
    )
    columns = ("#", "layout", "memory GiB", "step s", "MFU", "x-node GB", "x-node s")
    for column in (*columns, "why slower than #1"):
        table.add_column(
            column, justify="left" if column in ("layout", "why slower than #1") else "right"
        )
    for index, candidate in enumerate(result.ranked[:top], start=1):
        time = candidate.time
        table.add_row(
            str(index),
            Text(candidate.layout.describe()),
            f"{candidate.memory.total / 2**30:.1f}",
            f"{time.total:.3f}",
            f"{time.mfu:.1%}",
            f"{time.cross_node_bytes / 1e9:.2f}",
            f"{time.cross_node_seconds:.3f}",
            Text(why_slower(candidate, best)),
        )
    return table


@app.command()
def search(
    model: Annotated[
        str,
        typer.Argument(
            help="family:size (llama:7b, gpt2:small, moe:mixtral-8x7b) or gpt3-175b / llama3-405b"
        ),
    ],
    world: Annotated[int, typer.Option(help="ranks (devices) in the job", min=1)],
    global_batch: Annotated[int, typer.Option(help="sequences per optimizer step", min=1)],
    per_node: Annotated[int, typer.Option(help="devices per node", min=1)] = 8,
    device: Device = "H100-80GB",
    seq_len: Annotated[int, typer.Option(help="tokens per sequence", min=1)] = 2048,
    precision: Annotated[str, typer.Option(help="bf16 (fp32 masters), amp-bf16 or fp32")] = "bf16",
    top: Annotated[int, typer.Option(help="layouts to print", min=1)] = 5,
    zero: Annotated[str, typer.Option(help="ZeRO stages to consider")] = "0,1,2,3",
    recompute: Annotated[
        str, typer.Option(help="recomputation modes to consider")
    ] = "none,selective,full",
    links: Links = None,
    allow_quantized_comm: Annotated[
        bool,
        typer.Option(
            "--allow-quantized-comm",
            help="also plan ZeRO++'s int8/int4 codecs of the cross-node hops (qwZ, qgZ): "
            "fewer bytes, weights and gradients perturbed within their bounds",
        ),
    ] = False,
    checkpoint_every: Annotated[
        int,
        typer.Option(help="price a checkpoint saved every N steps into each step (0: none)", min=0),
    ] = 0,
    sync_checkpoints: Annotated[
        bool,
        typer.Option(
            "--sync-checkpoints",
            help="the saves are synchronous (checkpoint_io.async_save = false): the step "
            "waits for the write too",
        ),
    ] = False,
) -> None:
    """Rank the valid layouts of MODEL on WORLD devices by predicted step time."""
    from plait.planner.checkpoint_model import CheckpointPlan
    from plait.planner.layouts import PRECISIONS, Job, SearchSpace
    from plait.planner.published import resolve_shape
    from plait.planner.search import plan

    try:
        if precision not in PRECISIONS:
            raise PlaitError(f"--precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
        job = Job(
            model=resolve_shape(model),
            seq_len=seq_len,
            global_batch=global_batch,
            world=world,
            per_node=per_node,
            device=_device(device, links),
            precision=PRECISIONS[precision],
            checkpoint=CheckpointPlan(every=checkpoint_every, asynchronous=not sync_checkpoints)
            if checkpoint_every
            else None,
        )
        space = SearchSpace(
            zero_stages=_int_list(zero, "--zero"),
            recompute=tuple(m.strip() for m in recompute.split(",") if m.strip()),
            quantized_comm=allow_quantized_comm,
        )
        result = plan(job, space)
    except PlaitError as exc:
        _fail(exc)
        return
    console.print(
        f"{job.model.name}: {job.model.num_params / 1e9:.2f} B parameters, {world} × "
        f"{job.device.name} ({per_node} per node), global batch {global_batch} × {seq_len}; "
        f"{result.considered} layouts, {result.rejected_for_memory} do not fit",
        highlight=False,
        markup=False,
    )
    if not result.ranked:
        smallest = result.smallest_rejected
        hint = ""
        if smallest is not None:
            hint = (
                f" (the smallest, {smallest.layout.describe()}, needs "
                f"{smallest.memory.total / 2**30:.1f} GiB)"
            )
        console.print(
            f"[red]no layout fits in {job.device.usable_memory / 2**30:.1f} GiB{escape(hint)}[/red]"
        )
        raise typer.Exit(1)
    console.print(render_plan(result, top=top))
    for note in quantized_notes(result, top=top, allowed=allow_quantized_comm):
        console.print(note, highlight=False, markup=False)
    if job.checkpoint is not None:
        from plait.planner.checkpoint_model import checkpoint_cost

        best = result.ranked[0]
        step = best.time.total - best.time.checkpoint
        saves = checkpoint_cost(job, best.layout, best.memory, step)
        assert saves is not None
        console.print(f"#1 {saves.describe()}", highlight=False, markup=False)


def quantized_notes(result: Any, *, top: int, allowed: bool) -> list[str]:
    """Below the table: what each printed layout's codecs change (they alter the numerics, so
    the plan says so), or, where they were not planned but a printed layout could take them,
    how to have them planned."""
    from plait.planner.auto import quantized_comm_note
    from plait.planner.layouts import HIERARCHICAL

    shown = [c.layout for c in result.ranked[:top]]
    if not allowed:
        could = any(
            x.dp_algorithm == HIERARCHICAL and x.zero >= 2 and not x.dp_shard for x in shown
        )
        return [
            "ZeRO++'s codecs (qwZ, qgZ) were not planned: --allow-quantized-comm lets the plan "
            "quantize the cross-node hops (docs/zero-plus-plus.md)"
        ] if could else []  # fmt: skip
    rows: dict[str, list[str]] = {}
    for index, layout in enumerate(shown, start=1):
        note = quantized_comm_note(layout)
        if note:
            rows.setdefault(note, []).append(f"#{index}")
    return [
        f"{', '.join(numbers)} quantize what crosses nodes (allowed by --allow-quantized-comm): "
        f"{note} (docs/zero-plus-plus.md)"
        for note, numbers in rows.items()
    ]


@app.command()
def calibrate(
    hosts: Annotated[
        list[str] | None,
        typer.Option("--host", help="daemon host:port (repeatable); default $PLAIT_DAEMON"),
    ] = None,
    job: Annotated[str, typer.Option(help="only this job's spans")] = "",
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="where to write the fit")
    ] = None,
) -> None:
    """Fit α and β of the intra- and inter-node links to the daemon's recorded comm spans."""
    from plait.daemon.address import resolve_daemon_address
    from plait.planner.comm_model import default_calibration_path, fit_links
    from plait.planner.daemon_client import capture_trace, samples_from_trace

    targets = list(hosts) if hosts else [resolve_daemon_address()]
    try:
        documents = [capture_trace(host, job=job) for host in targets]
    except Exception as exc:  # grpc.RpcError and connection failures
        _fail(PlaitError(f"could not read spans from {', '.join(targets)}: {exc}"))
        return
    samples = samples_from_trace(documents)
    calibration = fit_links(samples, source=f"daemon spans from {', '.join(targets)}")
    if calibration.intra is None and calibration.inter is None:
        _fail(
            PlaitError(
                f"no usable comm spans in the daemons' windows ({len(samples)} spans); run a "
                "job with telemetry first"
            )
        )
        return
    path = output or default_calibration_path()
    calibration.save(path)
    for kind, fit in (("intra-node", calibration.intra), ("inter-node", calibration.inter)):
        if fit is None:
            console.print(f"{kind}: no spans (datasheet default stays)")
        else:
            console.print(
                f"{kind}: α {fit.alpha * 1e6:.1f} µs, β {fit.beta / 1e9:.2f} GB/s from "
                f"{fit.samples} spans (rms error {fit.rms_error_seconds * 1e3:.2f} ms)",
                highlight=False,
            )
            for own in fit.by_op:
                console.print(
                    f"  {own.op}: α {own.alpha * 1e6:.1f} µs, β {own.beta / 1e9:.2f} GB/s from "
                    f"{own.samples} spans",
                    highlight=False,
                    markup=False,
                )
    console.print(f"wrote {path}", markup=False)


@app.command()
def explain(
    config: Annotated[Path, typer.Option(help="the run's TOML config")],
    world: Annotated[int, typer.Option(help="ranks of the run", min=1)],
    hosts: Annotated[
        list[str] | None,
        typer.Option("--host", help="daemon host:port (repeatable); default $PLAIT_DAEMON"),
    ] = None,
    per_node: Annotated[int, typer.Option(help="devices per node", min=1)] = 8,
    device: Device = "H100-80GB",
    job: Annotated[str, typer.Option(help="job id (default: every job)")] = "",
    window_steps: Annotated[int, typer.Option(help="steps averaged", min=1)] = 20,
    links: Links = None,
) -> None:
    """Compare the prediction for CONFIG's layout with the daemon's measured step breakdown."""
    from plait.core.config import read_toml
    from plait.daemon.address import resolve_daemon_address
    from plait.planner.auto import job_for_config, layout_from_config
    from plait.planner.daemon_client import measured_breakdowns
    from plait.planner.explain import explain as compare
    from plait.planner.time_model import estimate_step_time

    targets = list(hosts) if hosts else [resolve_daemon_address()]
    try:
        data = read_toml(config)
        planned = job_for_config(
            data, world=world, per_node=per_node, device=_device(device, links)
        )
        layout = layout_from_config(data, world=world, per_node=per_node)
        prediction = estimate_step_time(planned, layout)
        ranks = measured_breakdowns(targets, job=job, window_steps=window_steps)
        explanation = compare(prediction, ranks)
    except (PlaitError, ValueError, OSError) as exc:
        _fail(exc)
        return
    except Exception as exc:  # grpc.RpcError
        _fail(PlaitError(f"could not read the breakdown from {', '.join(targets)}: {exc}"))
        return
    table = Table(
        title=f"{escape(layout.describe())}: predicted vs measured, ms per step "
        f"({explanation.ranks} ranks)"
    )
    for column in ("term", "predicted", "measured", "error"):
        table.add_column(column, justify="left" if column == "term" else "right")
    for row in explanation.rows:
        table.add_row(
            row.term,
            f"{row.predicted * 1e3:.1f}",
            f"{row.measured * 1e3:.1f}",
            f"{row.error * 1e3:+.1f}",
        )
    table.add_row(
        "step",
        f"{explanation.predicted_step * 1e3:.1f}",
        f"{explanation.measured_step * 1e3:.1f}",
        f"{(explanation.predicted_step - explanation.measured_step) * 1e3:+.1f}",
    )
    console.print(table)
    console.print(explanation.verdict(), highlight=False, markup=False)
