"""Hugging Face interop: plait weights <-> safetensors and the `config.json` transformers loads.

    from plait.plugins.huggingface import export_hf_from, load_hf_into
    export_hf_from(engine, Path("hf-out"))   # collective: every rank writes what it holds
    load_hf_into(engine, Path("hf-in"))      # every rank reads only the regions it holds

- `families`: the HF model families plait's built-in models map to (Llama, Mistral, Qwen2,
  GPT-2): tensor names, layouts and config fields, one table per family used both ways.
- `weights`: moving tensors — offline (`export_hf`, `import_hf`, used by `plait ckpt export /
  import`) and from / into a running job however it is sharded, through the state layout its
  strategies declare (`plait.core.state_chunks`).

Errors are `plait.core.errors.CheckpointError`, as for plait's own checkpoints.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.plugins.huggingface.weights import (
        ImportedHF,
        export_hf,
        export_hf_from,
        import_hf,
        load_hf_into,
    )

# Resolved on first use: importing the package loads neither torch's DCP nor safetensors.
_EXPORTS = {
    "ImportedHF": "weights",
    "export_hf": "weights",
    "export_hf_from": "weights",
    "import_hf": "weights",
    "load_hf_into": "weights",
}
__all__ = ["ImportedHF", "export_hf", "export_hf_from", "import_hf", "load_hf_into"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
