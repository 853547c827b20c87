"""A LoRA checkpoint merged into its base: the whole model, what peft's `merge_and_unload()` gives.

Every adapted linear's weight becomes

    W' = W + scale · B·A        scale = alpha / r  (alpha / sqrt(r) with use_rslora)

with `A` of shape `r × in` and `B` of shape `out × r` (a `transformers` `Conv1D`, GPT-2's, stores
`W` as `in × out` and gets the transpose), and every module to save (`modules_to_save`) is
replaced by its trained copy, as `merge_and_unload()` replaces peft's wrapper by it. The
checkpoint holds the adapters and those copies only; the base is read from where the user names
it and must hash to what the checkpoint recorded (`plait.plugins.lora.state.base_hash`, over the
names the job's `PeftModel` gave the frozen tensors), so adapters trained for one model are
never merged into another.

    weights = merged_weights(base, adapters, record)         # plait or transformers names
    model = merged_transformers_model(base_dir, adapters, record)  # then save_pretrained

`plait ckpt export --merged` writes the result as a folder `AutoModelForCausalLM.from_pretrained`
loads: `save_pretrained` for a `transformers` base, `export_hf` for plait's built-in models.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from plait.core.errors import CheckpointError, PlaitError
from plait.plugins.lora.config import PeftSection
from plait.plugins.lora.state import (
    ADAPTER,
    BASE_LAYER,
    ORIGINAL,
    PREFIX,
    TRAINED_COPY,
    record_hash,
)


def lora_scale(section: PeftSection) -> float:
    """The factor on B·A: alpha / r, or alpha / sqrt(r) with rank-stabilised LoRA."""
    return section.alpha / (math.sqrt(section.r) if section.use_rslora else section.r)


def lora_pairs(weights: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) of every adapted module, by the module's name in the base model."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.{ADAPTER}.weight"
            if name.endswith(suffix):
                module = name.removesuffix(suffix).removeprefix(PREFIX)
                parts.setdefault(module, {})[part] = tensor
    if not parts:
        raise PlaitError("the checkpoint holds no LoRA weights (no '.lora_A.' in any name)")
    incomplete = sorted(m for m, found in parts.items() if len(found) != 2)
    if incomplete:
        raise PlaitError(f"the checkpoint holds only one of lora_A and lora_B for {incomplete}")
    return {m: (found["lora_A"], found["lora_B"]) for m, found in sorted(parts.items())}


def trained_copies(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The modules to save's trained copies, by the name of the parameter they replace in the
    base model (`head.modules_to_save.default.weight` -> `head.weight`)."""
    return {
        name.removeprefix(PREFIX).replace(TRAINED_COPY, "."): tensor
        for name, tensor in weights.items()
        if TRAINED_COPY in name
    }


def saved_modules(weights: Iterable[str]) -> set[str]:
    """The modules to save, by name in the base model, from their trained copies' names."""
    return {n.removeprefix(PREFIX).split(TRAINED_COPY)[0] for n in weights if TRAINED_COPY in n}


def merged_weight(
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    *,
    transposed: bool = False,
) -> torch.Tensor:
    """W + scale · B·A (its transpose for a weight stored `in × out`), in W's dtype."""
    delta = (b.float() @ a.float()) * scale
    if transposed:
        delta = delta.T
    if tuple(delta.shape) != tuple(weight.shape):
        raise CheckpointError(
            f"the adapter's B·A has shape {tuple(delta.shape)}, the base weight "
            f"{tuple(weight.shape)}: the base is not the model the adapters were trained on"
        )
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def check_base(
    named: Iterable[tuple[str, torch.Tensor]],
    adapted: Iterable[str],
    record: Mapping[str, Any],
    *,
    source: str,
    saved: Iterable[str] = (),
) -> None:
    """Refuse a base whose frozen tensors do not hash to the checkpoint's record. `named` are
    the base model's parameters by its own names; `adapted` the modules that hold adapters,
    `saved` the modules to save (hashed as their frozen originals)."""
    modules, originals = set(adapted), set(saved)
    peft_named = []
    for name, tensor in named:
        module, _, leaf = name.rpartition(".")
        inside = f"{module}{BASE_LAYER}{leaf}" if module in modules else name
        for original in originals:
            if name.startswith(f"{original}."):
                inside = f"{original}{ORIGINAL}{name.removeprefix(f'{original}.')}"
        peft_named.append((PREFIX + inside, tensor))
    saved = record["base"]
    ours = record_hash(peft_named, saved)
    if ours != saved["sha256"]:
        raise CheckpointError(
            f"the checkpoint's adapters were trained on base {saved['name']!r} (sha256 "
            f"{saved['sha256'][:12]}…, {saved['parameters']} frozen tensors); {source} is "
            f"another model (sha256 {ours[:12]}…, {len(peft_named)} tensors): pass the base the "
            "job started from with --base"
        )


def section_of(record: Mapping[str, Any]) -> PeftSection:
    """The job's `[peft]` section, refused where the merge would leave trained tensors out."""
    section = PeftSection.model_validate(record["peft"])
    if section.bias != "none":
        raise PlaitError(
            f"merging adapters with trained biases is not supported yet (bias = {section.bias!r})"
        )
    return section


def _replaced(
    base: Mapping[str, torch.Tensor], copies: Mapping[str, torch.Tensor], *, source: str
) -> dict[str, torch.Tensor]:
    """Each trained copy in its base tensor's dtype, checked against that tensor."""
    missing = sorted(name for name in copies if name not in base)
    if missing:
        raise CheckpointError(f"{source} has no weights {missing} for the modules to save")
    for name, copy in copies.items():
        if tuple(copy.shape) != tuple(base[name].shape):
            raise CheckpointError(
                f"the trained copy of {name} has shape {tuple(copy.shape)}, {source}'s "
                f"{tuple(base[name].shape)}: the base is not the model it was trained on"
            )
    return {name: copy.to(base[name].dtype) for name, copy in copies.items()}


def merged_weights(
    base: Mapping[str, torch.Tensor],
    adapters: Mapping[str, torch.Tensor],
    record: Mapping[str, Any],
    *,
    source: str,
) -> dict[str, torch.Tensor]:
    """The base's tensors with every adapter merged in and every module to save replaced by
    its trained copy, by the base's own names (plait's for a built-in model); the base checked
    against the checkpoint's hash first."""
    scale = lora_scale(section_of(record))
    pairs = lora_pairs(adapters)
    missing = sorted(m for m in pairs if f"{m}.weight" not in base)
    if missing:
        raise CheckpointError(f"{source} has no weight for the adapted modules {missing}")
    copies = trained_copies(adapters)
    replaced = _replaced(base, copies, source=source)
    check_base(base.items(), pairs, record, source=source, saved=saved_modules(adapters))
    merged = dict(base)
    for module, (a, b) in pairs.items():
        merged[f"{module}.weight"] = merged_weight(base[f"{module}.weight"], a, b, scale)
    merged.update(replaced)
    return merged


def merged_transformers_model(
    base_dir: Path, adapters: Mapping[str, torch.Tensor], record: Mapping[str, Any]
) -> Any:
    """The `transformers` causal LM in `base_dir` with the adapters merged into it, in place:
    `save_pretrained` writes the merged model."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    scale = lora_scale(section_of(record))
    pairs = lora_pairs(adapters)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype="auto")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{base_dir}: not a model folder transformers loads: {exc}") from None
    modules = dict(model.named_modules())
    missing = sorted(m for m in pairs if m not in modules)
    if missing:
        raise CheckpointError(f"{base_dir} has no modules {missing}, which hold adapters")
    parameters = dict(model.named_parameters())
    replaced = _replaced(parameters, trained_copies(adapters), source=str(base_dir))
    saved = saved_modules(adapters)
    check_base(parameters.items(), pairs, record, source=str(base_dir), saved=saved)
    with torch.no_grad():
        for module, (a, b) in pairs.items():
            layer = modules[module]
            transposed = isinstance(layer, Conv1D)
            layer.weight.copy_(merged_weight(layer.weight, a, b, scale, transposed=transposed))
        for name, copy in replaced.items():
            parameters[name].copy_(copy)
    return model
