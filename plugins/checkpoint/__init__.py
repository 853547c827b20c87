"""Distributed checkpoints: sharded save/load with `torch.distributed.checkpoint`, exact resume.

    from plait.plugins.checkpoint import Checkpointer
    checkpointer = Checkpointer.from_config(engine, batches, config)   # [checkpoint_io]
    start = checkpointer.maybe_resume()
    ...  checkpointer.maybe_save(step + 1)  ...

- `state`: what a checkpoint holds, gathered from and applied to an engine through the
  canonical layout (original name, global shape, rectangular chunks) that
  `plait.core.state_chunks` reads from the `StateLayout` the engine's runtimes declare, so any
  layout — a third-party strategy's included — loads any other (DCP planners:
  `plait.core.dcp_planner`).
- `storage`: atomic directories, manifest, `latest`, keep-last-K, fallback to the previous one.
- `checkpointer`: the training-loop policy; `config`: the `[checkpoint_io]` section it reads.
- `save_events`: what rank 0 tells the daemon of each save (its start, then its outcome and
  cost), published on the core's span board for the telemetry to send.
- `offline`: whole-tensor reads and writes in one process, for `plait ckpt`.

Elsewhere: Hugging Face weights in `plait.plugins.huggingface`; the NaN/Inf guard, fault
injection and collective-timeout reports (configured in `[checkpoint_io]` too) in
`plait.plugins.resilience`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.checkpoint.config import CheckpointIOConfig, checkpoint_io_config
    from plait.plugins.checkpoint.storage import CheckpointError

# Resolved on first use: importing the package (e.g. for `plait ckpt`) stays cheap.
_EXPORTS = {
    "Checkpointer": "checkpointer",
    "CheckpointIOConfig": "config",
    "checkpoint_io_config": "config",
    "CheckpointError": "storage",
}
__all__ = ["CheckpointError", "CheckpointIOConfig", "Checkpointer", "checkpoint_io_config"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
