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
    merged: Annotated[
        bool,
        typer.Option(
            "--merged",
            help="with --format hf: a LoRA job's adapters merged into its base weights "
            "(W + alpha/r · B·A), the whole model, for AutoModelForCausalLM.from_pretrained",
        ),
    ] = False,
    base: Annotated[
        Path | None,
        typer.Option(
            "--base",
            help="with --merged: the base model the LoRA job started from, checked against the "
            "hash the checkpoint recorded: an HF model folder, or a plait checkpoint for a "
            "built-in model (default: the folder the checkpoint names, if it is one here)",
        ),
    ] = None,
) -> None:
    """Write a checkpoint's weights as Hugging Face safetensors plus config.json, or a LoRA
    job's adapters as peft's adapter_config.json plus adapter_model.safetensors."""
    from plait.plugins.checkpoint.offline import model_weights
    from plait.plugins.huggingface.weights import export_hf, model_fields
    from plait.plugins.models import resolve_model_config

    if merged and format != "hf":
        _fail(PlaitError(f"--merged writes a whole model (--format hf), not --format {format}"))
    if base is not None and not merged:
        _fail(PlaitError("--base names the base a LoRA job's adapters merge into: add --merged"))
    if merged:
        _export_merged(checkpoint, output, base=base, family=family)
        return
    if format == "peft":
        _export_peft(checkpoint, output)
        return
    if format != "hf":
        _fail(PlaitError(f"--format {format!r} is not supported; allowed: hf, peft"))
    try:
        weights, meta = model_weights(checkpoint)
        if any(".lora_" in name for name in weights):
            raise PlaitError(
                "the checkpoint holds a LoRA job's adapters, not a whole model: add --merged "
                "(the adapters merged into their base) or use --format peft (the adapters alone)"
            )
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


# A LoRA record's base name (`base_name`: the class of a model with no `name_or_path`) for each
# built-in model that exports to HF.
BUILTIN_BASES = {"Llama": "llama", "GPT2": "gpt2"}


def _export_merged(
    checkpoint: Path, output: Path, *, base: Path | None, family: str | None
) -> None:
    from plait.plugins.checkpoint.offline import model_weights, read_checkpoint
    from plait.plugins.huggingface.weights import export_hf, model_fields
    from plait.plugins.lora.export import saved_adapter
    from plait.plugins.lora.merge import merged_transformers_model, merged_weights
    from plait.plugins.models import resolve_model_config

    try:
        adapters, meta = model_weights(checkpoint)
        plugin_state = read_checkpoint(checkpoint, prefix="plugins.rank0").get("plugins.rank0")
        record = saved_adapter(plugin_state)
        builtin = _builtin_model(record, meta)
        if builtin is None:
            if family is not None:
                raise PlaitError(
                    f"--family {family} is for plait's built-in models; a transformers model is "
                    "written as itself"
                )
            folder = _transformers_base(base, record)
            model = merged_transformers_model(folder, adapters, record)
            model.save_pretrained(output)
            written = f"a {type(model).__name__}"
        else:
            weights, source = _builtin_base(base, record, builtin)
            merged = merged_weights(weights, adapters, record, source=source)
            overrides = meta["model"].get("overrides", {})
            config = resolve_model_config(builtin, meta["model"]["size"], overrides)
            fields = model_fields(config)
            chosen = export_hf(merged, output, model=builtin, fields=fields, family=family)
            written = f"an HF {chosen.model_type} ({chosen.architecture})"
    except PlaitError as exc:
        _fail(exc)
    console.print(
        f"wrote {written} with the LoRA adapters (r = {record['peft']['r']}) merged into base "
        f"{record['base']['name']!r} to {output}",
        highlight=False,
        markup=False,
    )


def _builtin_model(record: dict[str, Any], meta: dict[str, Any]) -> str | None:
    """The built-in model a LoRA record's base is, or None for a transformers causal LM."""
    name = record["base"]["name"]
    if record.get("task_type") == "CAUSAL_LM":
        return None
    builtin = BUILTIN_BASES.get(name)
    if builtin is not None and (meta.get("model") or {}).get("name") == builtin:
        return builtin
    raise PlaitError(
        f"only LoRA fine-tunes of a transformers causal LM or of plait's built-in llama and gpt2 "
        f"merge into a whole model; this checkpoint's base is {name!r}: export the adapters "
        "with --format peft"
    )


def _missing_base(record: dict[str, Any], what: str) -> PlaitError:
    saved = record["base"]
    return PlaitError(
        f"--merged needs the base weights, which a LoRA checkpoint does not hold: it names base "
        f"{saved['name']!r} (sha256 {saved['sha256'][:12]}…, {saved['parameters']} frozen "
        f"tensors); pass {what} with --base"
    )


def _transformers_base(base: Path | None, record: dict[str, Any]) -> Path:
    """The folder of a transformers base: --base, else the path the job loaded it from."""
    if base is None:
        named = Path(record["base"]["name"]).expanduser()
        if not (named / "config.json").is_file():
            raise _missing_base(
                record, "the folder it was loaded from (what save_pretrained wrote)"
            )
        return named
    if not (base / "config.json").is_file():
        raise PlaitError(f"--base {base}: no config.json there; pass the base model's folder")
    return base


def _builtin_base(
    base: Path | None, record: dict[str, Any], builtin: str
) -> tuple[dict[str, Any], str]:
    """A built-in base's weights by plait name, from an HF folder or a plait checkpoint."""
    from plait.plugins.checkpoint.offline import model_weights
    from plait.plugins.huggingface.weights import import_hf

    if base is None:
        raise _missing_base(
            record, f"its weights (a plait checkpoint of the {builtin}, or an HF folder)"
        )
    if (base / "config.json").is_file():
        imported = import_hf(base)
        if imported.model != builtin:
            raise PlaitError(f"--base {base} holds a {imported.model}, the adapters a {builtin}")
        return imported.weights, str(base)
    weights, _ = model_weights(base)
    return weights, str(base)


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
