"""Hugging Face weights: plait tensors <-> safetensors + the `config.json` transformers loads.

The families (Llama, Mistral, Qwen2 on plait's `llama`; GPT-2 on plait's `gpt2`), their tensor
names, layouts and config fields are in `families`; this module moves tensors.

Offline (`plait ckpt export/import`): `export_hf` writes full plait tensors as one family;
`import_hf` reads a folder (one safetensors file or shards) into plait tensors and the plait
model config that holds them.

A running job exports and imports through the state layout its strategies declare
(`plait.core.state_layout`), whatever they are: `export_hf_from` writes each rank's pieces of the
weights (replicas once) and assembles them on rank 0 (a `transformers` model the job trains is
then written by its own `save_pretrained`); `load_hf_into` has every rank read from the
safetensors files only the regions it holds (a block of a fused or transposed HF tensor).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from plait.core.errors import CheckpointError
from plait.core.state_chunks import (
    Staging,
    first_replica,
    layout_for,
    region_chunks,
    tensor_pieces,
)
from plait.plugins.huggingface.families import (
    LLAMA,
    HFFamily,
    Slot,
    family_for_export,
    family_named,
    hf_config,
    merge,
)


def plait_to_hf_name(name: str, family: HFFamily = LLAMA) -> str:
    """The HF tensor that holds plait parameter `name` (Llama naming by default)."""
    return family.slot(name).hf_name


def hf_to_plait_name(name: str, family: HFFamily = LLAMA) -> str | None:
    """The plait name of a one-to-one HF tensor, or None for tensors plait does not hold."""
    found = family.plait_slots(name)
    if len(found) > 1:
        raise CheckpointError(f"{name!r} holds {len(found)} plait tensors; use plait_slots")
    return found[0][0] if found else None


def model_fields(model_config: Any) -> dict[str, Any]:
    """The fields the families' config writers read, from a resolved built-in model config."""
    return {**model_config.model_dump(), "hidden_dim": model_config.hidden_dim}


def export_hf(
    weights: dict[str, torch.Tensor],
    out_dir: Path,
    *,
    model: str,
    fields: dict[str, Any],
    family: str | None = None,
) -> HFFamily:
    """Write `model.safetensors` and `config.json` for full plait `weights` of built-in `model`
    (config `fields`) as HF `family` (default: the model's natural one). Returns the family."""
    from safetensors.torch import save_file

    chosen = family_for_export(model, fields, family)
    placed: dict[str, list[tuple[Slot, torch.Tensor]]] = {}
    for name, tensor in weights.items():
        slot = chosen.slot(name)
        placed.setdefault(slot.hf_name, []).append((slot, tensor))
    tensors = {hf_name: merge(hf_name, parts) for hf_name, parts in placed.items()}
    dtype = next(iter(tensors.values())).dtype
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(chosen, fields, dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return chosen


@dataclass(slots=True)
class ImportedHF:
    """An HF folder read into plait: weights by plait name and the model that holds them."""

    family: HFFamily
    weights: dict[str, torch.Tensor]
    overrides: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.family.plait_model


def read_hf_config(hf_dir: Path) -> tuple[HFFamily, dict[str, Any]]:
    """The family and the parsed `config.json` of an HF folder."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{hf_dir} has no config.json")
    config = json.loads(config_path.read_text())
    return family_named(str(config.get("model_type"))), config


def _safetensors_files(hf_dir: Path) -> list[Path]:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir} has no *.safetensors files")
    return files


def import_hf(hf_dir: Path) -> ImportedHF:
    """Read an HF checkpoint folder (local files only) into plait-named full tensors."""
    from safetensors.torch import load_file

    family, config = read_hf_config(hf_dir)
    overrides, notes = family.from_config(config)
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(hf_dir):
        for hf_name, tensor in load_file(str(file)).items():
            for name, slot in family.plait_slots(hf_name):
                weights[name] = slot.extract(tensor)
    output, embedding = family.tied
    if output not in weights and embedding in weights:
        weights[output] = weights[embedding].clone()
    return ImportedHF(family, weights, overrides, notes)


def export_hf_from(
    engine: Any, out_dir: Path, *, family: str | None = None, process_group: Any = None
) -> Path:
    """Write a running job's model as HF safetensors, however it is sharded.

    Collective: every rank writes the pieces its strategies declare (DCP, replicas once) into a
    staging directory under `out_dir`, which must be shared by the ranks; rank 0 reads them
    back whole and writes `model.safetensors` and `config.json`. A built-in model is written as
    HF `family`; a `transformers` model the job trains (passed to `plait.initialize`) is written
    by its own `save_pretrained`, with the whole tensors, so the folder is what
    `from_pretrained` reads (its own names and layout; `family` does not apply).
    """
    import shutil

    import torch.distributed as dist

    transformers_model = _transformers_model_of(engine)
    if engine.model_config is None and transformers_model is None:
        raise CheckpointError(
            "only plait's built-in models and transformers models export to HF from a running job"
        )
    if transformers_model is None:
        model, fields = engine.config.model.name, model_fields(engine.model_config)
        family_for_export(model, fields, family)  # refuse on every rank before any collective
    elif family is not None:
        raise CheckpointError(
            f"export_hf_from: family={family!r} is for plait's built-in models; a transformers "
            "model is written as itself"
        )
    staging = out_dir / ".plait-export"
    _stage_whole_tensors(engine, staging, process_group)
    if engine.mesh.rank == 0:
        from plait.core.dcp_planner import read_tensors

        tensors = read_tensors(staging)
        if transformers_model is None:
            export_hf(tensors, out_dir, model=model, fields=fields, family=family)
        else:
            _save_pretrained(transformers_model, tensors, out_dir)
        shutil.rmtree(staging)
    if dist.is_initialized():
        dist.barrier(group=process_group)
    return out_dir


def _stage_whole_tensors(engine: Any, staging: Path, process_group: Any) -> None:
    """Every rank writes the pieces of the weights it declares (replicas once) under `staging`."""
    import torch.distributed.checkpoint as dcp

    from plait.core.dcp_planner import ChunkedValue, ChunkSavePlanner

    is_writer = first_replica(engine)
    state = {
        name: ChunkedValue(tensor_pieces(entry.value, is_writer=is_writer))
        for name, entry in layout_for(engine).by_name().items()
    }
    dcp.save(
        state,
        storage_writer=dcp.FileSystemWriter(staging, single_file_per_rank=True),
        planner=ChunkSavePlanner(),
        process_group=process_group,
    )


def _transformers_model_of(engine: Any) -> Any:
    """The `transformers` model an engine trains (its module, or what pipeline stages were
    cut from), or None."""
    from plait.core.transformers_models import is_transformers_model

    pipeline = engine.context.pipeline
    for candidate in (engine.module, pipeline.source_model if pipeline is not None else None):
        if candidate is not None and is_transformers_model(candidate):
            return candidate
    return None


def _save_pretrained(model: Any, tensors: dict[str, torch.Tensor], out_dir: Path) -> None:
    """`model.save_pretrained` with the job's whole tensors (the ranks' pieces put together)
    and the model's persistent buffers, which every rank holds whole."""
    state = dict(tensors)
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, tensor in model.state_dict().items():
        if name not in state and name not in parameters:
            state[name] = tensor.detach()
    model.save_pretrained(out_dir, state_dict=state)


@torch.no_grad()
def load_hf_into(engine: Any, hf_dir: Path) -> int:
    """Load an HF checkpoint folder into a running job in place; each rank reads only the
    regions of each tensor that its strategies declare it holds. Returns the number of tensors."""
    from safetensors import safe_open

    family, _ = read_hf_config(hf_dir)
    if family.plait_model != engine.config.model.name:
        raise CheckpointError(
            f"{hf_dir} holds an HF {family.model_type}, which plait's {family.plait_model} "
            f"model holds; this job runs {engine.config.model.name!r}"
        )
    layout = layout_for(engine)
    entries = layout.by_name()
    staging = Staging()
    with contextlib.ExitStack() as stack:
        where: dict[str, Any] = {}
        for file in _safetensors_files(hf_dir):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for hf_name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                where[family.canonical(hf_name)] = (handle, hf_name)
        for name, entry in entries.items():
            slot = _present_slot(family, name, where)
            if slot is None:
                raise CheckpointError(f"{hf_dir} has no tensor {family.slot(name).hf_name!r}")
            handle, stored_name = where[slot.hf_name]
            source = handle.get_slice(stored_name)
            hf_shape = tuple(source.get_shape())
            if slot.plait_shape(hf_shape) != tuple(entry.value.global_shape):
                raise CheckpointError(
                    f"{slot.hf_name}: holds {name} of shape {slot.plait_shape(hf_shape)} in "
                    f"{hf_dir}, this model has {tuple(entry.value.global_shape)}"
                )
            for piece in entry.value.pieces:
                for chunk in region_chunks(piece.region, staging.storage(piece)):
                    index = [
                        slice(o, o + n)
                        for o, n in zip(chunk.offsets, chunk.tensor.shape, strict=True)
                    ]
                    chunk.tensor.copy_(slot.read(source, hf_shape, index))
    staging.write_back()
    layout.finish_load()
    return len(entries)


def _present_slot(family: HFFamily, name: str, where: dict[str, Any]) -> Slot | None:
    """Where `name` is in this checkpoint; the embedding for a tied checkpoint's output."""
    slot = family.slot(name)
    if slot.hf_name in where:
        return slot
    output, embedding = family.tied
    if name == output:
        tied = family.slot(embedding)
        return tied if tied.hf_name in where else None
    return None
