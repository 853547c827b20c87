"""`plait ckpt`: inspect, export (Hugging Face safetensors), import and convert checkpoints offline.

Checkpoints store tensors by original name and global shape, so none of these commands needs to
know how the job that wrote a checkpoint was sharded, and any job can load what they write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from plait.core.errors import PlaitError

app = typer.Typer(help="Inspect, export, import and convert checkpoints.", no_args_is_help=True)
console = Console()


def _fail(exc: Exception) -> None:
    console.print(f"[red]error:[/red] {exc}", highlight=False)
    raise typer.Exit(2)


@app.command()
def info(
    checkpoint: Annotated[Path, typer.Argument(help="a checkpoint, or a directory of them")],
) -> None:
    """Verify a checkpoint against its manifest and summarise what it holds."""
    from plait.plugins.checkpoint.offline import read_checkpoint
    from plait.plugins.checkpoint.storage import resolve_checkpoint, verify

    try:
        directory = resolve_checkpoint(checkpoint)
        verdict = verify(directory)
        if not verdict.ok:
            raise PlaitError(f"{directory} is unusable: {verdict.problem}")
        objects = read_checkpoint(directory, prefix="meta")
        weights = read_checkpoint(directory, prefix="model.", with_objects=False)
    except PlaitError as exc:
        _fail(exc)
    meta = objects.get("meta", {})
    numel = sum(t.numel() for t in weights.values())
    console.print(f"[green]ok[/green] {directory}", highlight=False)
    console.print(
        f"{len(weights)} tensors, {numel:,} parameters · model {meta.get('model')} · saved by "
        f"{meta.get('world_size', '?')} ranks {meta.get('degrees', '')}",
        highlight=False,
    )


@app.command("export")
def export(
    checkpoint: Annotated[Path, typer.Argument(help="a checkpoint, or a directory of them")],
    output: Annotated[Path, typer.Option("-o", "--output", help="directory to write")],
    format: Annotated[str, typer.Option("--format", help="output format: hf")] = "hf",
) -> None:
    """Write a checkpoint's Llama weights as Hugging Face safetensors plus config.json."""
    from plait.plugins.checkpoint.hf import export_hf
    from plait.plugins.checkpoint.offline import model_weights
    from plait.plugins.models import resolve_model_config

    if format != "hf":
        _fail(PlaitError(f"--format {format!r} is not supported; allowed: hf"))
    try:
        weights, meta = model_weights(checkpoint)
        model = meta.get("model") or {}
        if model.get("name") != "llama":
            raise PlaitError(f"only Llama checkpoints export to HF, this one is {model!r}")
        config = resolve_model_config("llama", model["size"], model.get("overrides", {}))
        fields = {**config.model_dump(), "hidden_dim": config.hidden_dim}  # type: ignore[attr-defined]
        export_hf(weights, fields, output)
    except PlaitError as exc:
        _fail(exc)
    console.print(f"wrote {len(weights)} tensors to {output}", highlight=False)


@app.command("import")
def import_(
    source: Annotated[Path, typer.Argument(help="directory with config.json and *.safetensors")],
    output: Annotated[Path, typer.Option("-o", "--output", help="checkpoint root to write")],
    step: Annotated[int, typer.Option("--step", help="step number to give the checkpoint")] = 0,
) -> None:
    """Read Hugging Face Llama safetensors (local files) into a plait checkpoint (weights only)."""
    from plait.plugins.checkpoint.hf import import_hf
    from plait.plugins.checkpoint.offline import write_checkpoint
    from plait.plugins.checkpoint.state import FORMAT

    try:
        weights, overrides = import_hf(source)
        model = {"name": "llama", "size": "tiny", "overrides": overrides}
        state = {f"model.{k}": v for k, v in weights.items()}
        state["meta"] = {"format": FORMAT, "world_size": 1, "degrees": {}, "model": model}
        path = write_checkpoint(output, step, state)
    except PlaitError as exc:
        _fail(exc)
    console.print(f"wrote {path}; train from it with:", highlight=False)
    console.print(f'  --set checkpoint_io.init_from="{path}"', highlight=False)
    for key, value in overrides.items():
        console.print(f"  --set model.overrides.{key}={value}", highlight=False)


@app.command()
def convert(
    source: Annotated[Path, typer.Argument(help="a checkpoint (dcp) or a torch.save file")],
    output: Annotated[Path, typer.Option("-o", "--output", help="file or checkpoint root")],
    to: Annotated[str, typer.Option("--to", help="torch (one file) or dcp (a checkpoint)")],
    step: Annotated[int, typer.Option("--step", help="step number for --to dcp")] = 0,
) -> None:
    """Convert between a sharded checkpoint and one consolidated `torch.save` file."""
    import torch

    from plait.plugins.checkpoint.offline import read_checkpoint, write_checkpoint

    try:
        if to == "torch":
            state = read_checkpoint(source)
            output.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, output)
            console.print(f"wrote {len(state)} entries to {output}", highlight=False)
        elif to == "dcp":
            state = torch.load(source, map_location="cpu", weights_only=False)
            if not isinstance(state, dict):
                raise PlaitError(f"{source} does not hold a dict of checkpoint entries")
            path = write_checkpoint(output, step, state)
            console.print(f"wrote {path}", highlight=False)
        else:
            raise PlaitError(f"--to {to!r} is not supported; allowed: torch, dcp")
    except PlaitError as exc:
        _fail(exc)
