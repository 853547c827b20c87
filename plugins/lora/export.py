"""A LoRA checkpoint as a folder peft loads: `adapter_config.json` and
`adapter_model.safetensors`, for `peft.PeftModel.from_pretrained(base, folder)`.

The checkpoint holds the adapters under the names the job's `PeftModel` gives them
(`base_model.model.<module>.lora_A.default.weight`) and its `[peft]` section in the adapter
transform's plugin state (`plait.plugins.lora.state`); peft saves the same tensors without the
adapter's name (`….lora_A.weight`) and adds it back when it loads them. A module to save
(`modules_to_save`) is the trained copy, `<module>.modules_to_save.default.weight` in the
checkpoint, which peft saves under the module's own name (`<module>.weight`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from plait.core.errors import PlaitError
from plait.plugins.lora.config import PeftSection, lora_config
from plait.plugins.lora.state import ADAPTER, KEY, TRAINED_COPY

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def saved_adapter(plugin_state: Any) -> dict[str, Any]:
    """The adapter transform's record among a checkpoint's plugin states (`plugins.rank0`)."""
    entries = plugin_state if isinstance(plugin_state, list) else [plugin_state]
    for entry in entries:
        if isinstance(entry, Mapping) and KEY in entry:
            return dict(entry[KEY])
    raise PlaitError(
        "the checkpoint holds no LoRA adapter record: it was not written by a job with "
        'parallel.transforms = { adapter = "lora" }'
    )


def peft_tensors(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters, and the trained copies of the modules to save, under the names peft saves
    them with (the adapter's name dropped; a copy under its module's own name)."""
    chosen = {
        name.replace(f".{ADAPTER}.", "."): tensor.contiguous()
        for name, tensor in weights.items()
        if ".lora_" in name
    }
    if not chosen:
        raise PlaitError("the checkpoint holds no LoRA weights (no '.lora_' in any name)")
    for name, tensor in weights.items():
        if TRAINED_COPY in name:
            chosen[name.replace(TRAINED_COPY, ".")] = tensor.contiguous()
    return chosen


def export_peft(
    weights: Mapping[str, torch.Tensor], record: Mapping[str, Any], output: Path
) -> dict[str, torch.Tensor]:
    """Write `output/adapter_config.json` and `output/adapter_model.safetensors`; the tensors
    written, by their peft names."""
    from safetensors.torch import save_file

    section = PeftSection.model_validate(record["peft"])
    if section.bias != "none":
        raise PlaitError(
            "exporting adapters with trained biases to peft is not supported yet "
            f"(bias = {section.bias!r})"
        )
    tensors = peft_tensors(weights)
    config = lora_config(section, task_type=record.get("task_type"))
    config.base_model_name_or_path = record["base"]["name"]
    output.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(output))  # adapter_config.json, as peft writes it
    save_file(tensors, str(output / WEIGHTS_FILE), metadata={"format": "pt"})
    return tensors
