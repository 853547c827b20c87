"""Distributed checkpoints: sharded save/load with `torch.distributed.checkpoint`, exact resume.

    from plait.plugins.checkpoint import Checkpointer
    checkpointer = Checkpointer.from_config(engine, batches, config)   # [checkpoint_io]
    start = checkpointer.maybe_resume()
    ...  checkpointer.maybe_save(step + 1)  ...

- `layout`: the canonical layout (original FQN, global shape, rectangular chunks), the
  `StateLayout` protocol a runtime returns from `checkpoint_layout()`, and `layout_for(engine)`;
  `placements` (tensor-parallel slices, pipeline chunk names) and `layouts_zero` (flat ZeRO
  shards) describe the built-in runtimes' state, so any layout loads any other.
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
    from plait.plugins.checkpoint.layout import (
        Placement,
        ReplicatedLayout,
        StateLayout,
        TensorChunk,
        TensorPieces,
        flat_range_chunks,
    )
    from plait.plugins.checkpoint.storage import CheckpointError

# Resolved on first use: importing the package (e.g. for the timeouts plugin) stays cheap.
_EXPORTS = {
    "Checkpointer": "checkpointer",
    "CheckpointIOConfig": "checkpointer",
    "checkpoint_io_config": "checkpointer",
    "CheckpointError": "storage",
    "Placement": "layout",
    "ReplicatedLayout": "layout",
    "StateLayout": "layout",
    "TensorChunk": "layout",
    "TensorPieces": "layout",
    "flat_range_chunks": "layout",
}
__all__ = [
    "CheckpointError",
    "CheckpointIOConfig",
    "Checkpointer",
    "Placement",
    "ReplicatedLayout",
    "StateLayout",
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
