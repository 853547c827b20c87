"""Distributed checkpoints: sharded save/load with `torch.distributed.checkpoint`, exact resume.

    from plait.plugins.checkpoint import Checkpointer
    checkpointer = Checkpointer.from_config(engine, batches, config)   # [checkpoint_io]
    start = checkpointer.maybe_resume()
    ...  checkpointer.maybe_save(step + 1)  ...

- `layout`: the canonical layout (original name, global shape, rectangular chunks), read from
  the `plait.core.state_layout.StateLayout` the engine's runtimes declare (`state_layout()`),
  so any layout — a third-party strategy's included — loads any other.
- `planner`: DCP planners for chunked values; `state`: what a checkpoint holds;
  `storage`: atomic directories, manifest, `latest`, keep-last-K, fallback to the previous one.
- `checkpointer`: the training-loop policy and the `[checkpoint_io]` section.
- `guard`: skip steps with NaN/Inf gradients; `fault_injection`: SIGKILL a rank for restart
  tests.
- `hf`: Hugging Face safetensors export/import of Llama weights.
- `timeouts`: the `plait_communicate` wrapper that turns a collective timeout into an error
  naming the op, its sequence number and the ranks that did not arrive.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.plugins.checkpoint.checkpointer import (
        Checkpointer,
        CheckpointIOConfig,
        checkpoint_io_config,
    )
    from plait.plugins.checkpoint.layout import TensorChunk, TensorPieces, flat_range_chunks
    from plait.plugins.checkpoint.storage import CheckpointError

# Resolved on first use: importing the package (e.g. for the timeouts plugin) stays cheap.
_EXPORTS = {
    "Checkpointer": "checkpointer",
    "CheckpointIOConfig": "checkpointer",
    "checkpoint_io_config": "checkpointer",
    "CheckpointError": "storage",
    "TensorChunk": "layout",
    "TensorPieces": "layout",
    "flat_range_chunks": "layout",
}
__all__ = [
    "CheckpointError",
    "CheckpointIOConfig",
    "Checkpointer",
    "TensorChunk",
    "TensorPieces",
    "checkpoint_io_config",
    "flat_range_chunks",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
