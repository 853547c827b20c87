"""`plait ckpt`: inspect, export (Hugging Face safetensors), import and convert checkpoints offline.

Checkpoints store tensors by original name and global shape, so none of these commands needs to
know how the job that wrote a checkpoint was sharded, and any job can load what they write.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from plait.core.errors import PlaitError
from plait.training.output import make_console, print_error

app = typer.Typer(help="Inspect, export, import and convert checkpoints.", no_args_is_help=True)
console = make_console()


def _fail(exc: Exception) -> None:
    print_error(console, exc)
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
    console.print(Text.assemble(("ok", "green"), f" {directory}"), soft_wrap=True)
    for label, value in info_rows(directory, objects.get("meta", {}), weights):
        console.print(f"{label:<10} {value}", highlight=False, soft_wrap=True, markup=False)


def info_rows(
    directory: Path, meta: dict[str, Any], weights: dict[str, Any]
) -> list[tuple[str, str]]:
    """`plait ckpt info`'s lines, as (label, text): no Python reprs, plurals that agree."""
    from plait.plugins.checkpoint.storage import MANIFEST

    numel = sum(t.numel() for t in weights.values())
    manifest = json.loads((directory / MANIFEST).read_text())
    files = manifest.get("files", {})
    size = sum(int(f.get("size", 0)) for f in files.values())
    model = meta.get("model") or {}
    model_name = (
        "/".join(str(model[k]) for k in ("name", "size") if model.get(k))
        if isinstance(model, dict)
        else str(model)
    ) or "a model of its own (not a built-in family)"
    world = meta.get("world_size")
    degrees = meta.get("degrees") or {}
    layout = " ".join(f"{axis}={degree}" for axis, degree in degrees.items())
    saved_by = (
        f"{_count(world, 'rank')}" if isinstance(world, int) else "an unknown number of ranks"
    )
    if layout:
        saved_by += f" ({layout})"
    if meta.get("dp_strategy"):
        saved_by += f" · dp strategy {meta['dp_strategy']}"
    rows = [
        ("step", str(manifest.get("step", "?"))),
        ("model", f"{model_name} · {_count(len(weights), 'tensor')} · {numel:,} parameters"),
        ("saved by", saved_by),
        (
            "files",
            f"{_count(len(files), 'file')}, {size / 2**20:,.1f} MiB · sizes and CRC-32s verified",
        ),
    ]
    if meta.get("format"):
        rows.append(("format", str(meta["format"])))
    return rows


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


@app.command("export")
def export(
    checkpoint: Annotated[Path, typer.Argument(help="a checkpoint, or a directory of them")],
    output: Annotated[Path, typer.Option("-o", "--output", help="directory to write")],
    format: Annotated[
        str,
        typer.Option(
            "--format",
            help="output format: hf (the whole model), or peft (a LoRA job's adapters, for "
            "peft.PeftModel.from_pretrained)",
        ),
    ] = "hf",
    family: Annotated[
        str | None,
        typer.Option(
            "--family",
            help="HF model_type to write: llama, mistral or qwen2 for a plait llama (default "
            "qwen2 with qkv_bias, else llama); gpt2 for a plait gpt2",
        ),
    ] = None,
) -> None:
    """Write a checkpoint's weights as Hugging Face safetensors plus config.json, or a LoRA
    job's adapters as peft's adapter_config.json plus adapter_model.safetensors."""
    from plait.plugins.checkpoint.offline import model_weights
    from plait.plugins.huggingface.weights import export_hf, model_fields
    from plait.plugins.models import resolve_model_config

    if format == "peft":
        _export_peft(checkpoint, output)
        return
    if format != "hf":
        _fail(PlaitError(f"--format {format!r} is not supported; allowed: hf, peft"))
    try:
        weights, meta = model_weights(checkpoint)
        model = meta.get("model") or {}
        name = model.get("name")
        if name not in ("llama", "gpt2"):
            raise PlaitError(
                f"only plait's built-in llama and gpt2 models export to HF, this one is {model!r}"
            )
        config = resolve_model_config(name, model["size"], model.get("overrides", {}))
        chosen = export_hf(weights, output, model=name, fields=model_fields(config), family=family)
    except PlaitError as exc:
        _fail(exc)
    console.print(
        f"wrote {len(weights)} tensors as an HF {chosen.model_type} ({chosen.architecture}) "
        f"to {output}",
        highlight=False,
        markup=False,
    )


def _export_peft(checkpoint: Path, output: Path) -> None:
    from plait.plugins.checkpoint.offline import model_weights, read_checkpoint
    from plait.plugins.lora.export import export_peft, saved_adapter

    try:
        weights, _ = model_weights(checkpoint)
        plugin_state = read_checkpoint(checkpoint, prefix="plugins.rank0").get("plugins.rank0")
        record = saved_adapter(plugin_state)
        written = export_peft(weights, record, output)
    except PlaitError as exc:
        _fail(exc)
    console.print(
        f"wrote {len(written)} LoRA tensors (r = {record['peft']['r']}) for base "
        f"{record['base']['name']!r} to {output}",
        highlight=False,
        markup=False,
    )


def _check_weights(model: str, overrides: dict[str, Any], weights: dict[str, Any]) -> None:
    """The imported tensors are exactly the parameters of the plait model they configure."""
    import torch

    from plait.core.kernels import Kernels
    from plait.core.plugins import Plugins
    from plait.plugins.models import GPT2, Llama, resolve_model_config

    config = resolve_model_config(model, "tiny", overrides)
    build = {"llama": Llama, "gpt2": GPT2}[model]
    with torch.device("meta"):
        module = build(config, Kernels(Plugins.create(autoload=False)))  # type: ignore[arg-type]
    expected = {name: tuple(p.shape) for name, p in module.named_parameters()}
    got = {name: tuple(t.shape) for name, t in weights.items()}
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
        raise PlaitError(
            f"HF tensors do not fill plait's {model}: missing {missing}, extra {extra}"
        )
    wrong = [f"{n} {got[n]} != {expected[n]}" for n in expected if got[n] != expected[n]]
    if wrong:
        raise PlaitError(f"HF tensor shapes do not match config.json: {'; '.join(wrong)}")


@app.command("import")
def import_(
    source: Annotated[Path, typer.Argument(help="directory with config.json and *.safetensors")],
    output: Annotated[Path, typer.Option("-o", "--output", help="checkpoint root to write")],
    step: Annotated[int, typer.Option("--step", help="step number to give the checkpoint")] = 0,
) -> None:
    """Read a Hugging Face Llama, Mistral, Qwen2 or GPT-2 folder (local files) into a plait
    checkpoint (weights only)."""
    from plait.plugins.checkpoint.offline import write_checkpoint
    from plait.plugins.checkpoint.state import FORMAT
    from plait.plugins.huggingface.weights import import_hf

    try:
        imported = import_hf(source)
        _check_weights(imported.model, imported.overrides, imported.weights)
        model = {"name": imported.model, "size": "tiny", "overrides": imported.overrides}
        state: dict[str, Any] = {f"model.{k}": v for k, v in imported.weights.items()}
        state["meta"] = {"format": FORMAT, "world_size": 1, "degrees": {}, "model": model}
        path = write_checkpoint(output, step, state)
    except PlaitError as exc:
        _fail(exc)
    for note in imported.notes:
        console.print(Text.assemble(("note:", "yellow"), f" {note}"))
    console.print(
        f"wrote {path} (an HF {imported.family.model_type} as plait's {imported.model}); "
        "train from it with:",
        highlight=False,
        markup=False,
    )
    console.print(f'  --set checkpoint_io.init_from="{path}"', highlight=False, markup=False)
    console.print(f"  --set model.name={imported.model} --set model.size=tiny", highlight=False)
    for key, value in imported.overrides.items():
        console.print(
            f"  --set model.overrides.{key}={json.dumps(value)}", highlight=False, markup=False
        )


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
            console.print(f"wrote {len(state)} entries to {output}", highlight=False, markup=False)
        elif to == "dcp":
            state = torch.load(source, map_location="cpu", weights_only=False)
            if not isinstance(state, dict):
                raise PlaitError(f"{source} does not hold a dict of checkpoint entries")
            path = write_checkpoint(output, step, state)
            console.print(f"wrote {path}", highlight=False, markup=False)
        else:
            raise PlaitError(f"--to {to!r} is not supported; allowed: torch, dcp")
    except PlaitError as exc:
        _fail(exc)
