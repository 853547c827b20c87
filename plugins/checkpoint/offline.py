"""Checkpoints in one process, without an engine: read full tensors, write a new checkpoint.

Used by `plait ckpt export/import/convert`. A checkpoint is layout-independent (tensors by FQN
and global shape), so offline tools read whole tensors and never need to know how the job that
wrote it was sharded.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from plait.core.dcp_planner import ChunkedValue, ChunkSavePlanner, read_tensors
from plait.core.errors import CheckpointError
from plait.core.state_chunks import TensorPieces
from plait.plugins.checkpoint.storage import (
    describe_files,
    publish,
    resolve_checkpoint,
    temp_dir_name,
    verify,
    write_manifest,
)


def read_checkpoint(path: Path, *, prefix: str = "", with_objects: bool = True) -> dict[str, Any]:
    """Every entry of a checkpoint whose key starts with `prefix`, tensors whole, on the CPU."""
    directory = resolve_checkpoint(path)
    verdict = verify(directory)
    if not verdict.ok:
        raise CheckpointError(f"checkpoint {directory} is unusable: {verdict.problem}")
    return read_tensors(directory, prefix=prefix, with_objects=with_objects)


def model_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(plait-named full weights, the saved `meta` entry) of a checkpoint."""
    state = read_checkpoint(path, prefix="model.")
    meta = read_checkpoint(path, prefix="meta").get("meta", {})
    return {k.removeprefix("model."): v for k, v in state.items()}, meta


def write_checkpoint(root: Path, step: int, state: dict[str, Any], *, keep: int = 0) -> Path:
    """Write a flat state dict (full tensors and objects) as a published `step-N` under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    temp = root / temp_dir_name(step)
    if temp.exists():
        shutil.rmtree(temp)
    values = {
        k: ChunkedValue(TensorPieces.whole(v.contiguous())) if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            values,
            storage_writer=dcp.FileSystemWriter(temp, single_file_per_rank=True, sync_files=True),
            planner=ChunkSavePlanner(),
            no_dist=True,
        )
    names = sorted(p.name for p in temp.iterdir() if p.name.endswith(".distcp"))
    write_manifest(temp, describe_files(temp, [*names, ".metadata"]), step)
    return publish(root, temp, step, keep=keep)
