"""What a training checkpoint holds, and how it is gathered from and applied to an engine.

Keys of the flat DCP state dict (every tensor by original FQN and global shape):

    model.<fqn>                      parameter chunks
    optim.<fqn>.exp_avg / .exp_avg_sq  optimizer state chunks (parameter-shaped)
    optim.<fqn>.step                 optimizer step count
    optim.param_groups               hyperparameters per group (lr, betas, eps, weight decay)
    lr_scheduler                     the scheduler's state_dict
    sampler                          `TokenBatches.state_dict()` (dp-independent position)
    train.step                       optimizer steps done
    rng.rank<r>                      torch CPU/CUDA, Python and NumPy generator states of rank r
    plugins.rank<r>                  `plait_checkpoint_state(rank=r)` results
    meta                             world size, degrees, model name and config

Replicated values (every non-`rank<r>` key on a data-parallel job) are written once: DCP's
global plan deduplicates identical write items across ranks.
"""

from __future__ import annotations

import copy
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from plait.core.dcp_planner import ChunkedValue, ChunkLoadPlanner, ChunkSavePlanner
from plait.core.errors import CheckpointError
from plait.core.state_chunks import (
    Staging,
    TensorPieces,
    first_replica,
    layout_for,
    tensor_pieces,
)
from plait.core.state_layout import LoadedFrom, StateLayout
from plait.core.training_state import (
    apply_schedule,
    ensure_optimizer_state,
    group_hyperparameters,
)

FORMAT = "plait-dcp-1"


def model_key(fqn: str) -> str:
    return f"model.{fqn}"


def optim_key(fqn: str, entry: str) -> str:
    return f"optim.{fqn}.{entry}"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def engine_state_dict(engine: Any, *, batches: Any = None) -> dict[str, Any]:
    """The flat state dict of an engine (and its data sampler) for `dcp.save`.

    Tensors are the engine's own storage (views): a write that outlives the step needs a copy
    first (`plait.plugins.checkpoint.staging`).
    """
    layout = layout_for(engine)
    rank = engine.mesh.rank
    is_writer = first_replica(engine)
    state: dict[str, Any] = {}
    for fqn, entry in layout.by_name().items():
        pieces = tensor_pieces(entry.value, is_writer=is_writer)
        pieces.check(fqn)
        state[model_key(fqn)] = ChunkedValue(pieces)
        for key, tensor in entry.optimizer_state.items():
            pieces = tensor_pieces(tensor, is_writer=is_writer)
            pieces.check(optim_key(fqn, key))
            state[optim_key(fqn, key)] = ChunkedValue(pieces)
        if entry.step is not None:
            state[optim_key(fqn, "step")] = _plain_step(entry.step.get())
    state["optim.param_groups"] = group_hyperparameters(engine.optimizer)
    if engine.lr_scheduler is not None:
        state["lr_scheduler"] = copy.deepcopy(engine.lr_scheduler.state_dict())
    if batches is not None:
        state["sampler"] = dict(batches.state_dict())
    state["train.step"] = int(engine.global_step)
    state[f"rng.rank{rank}"] = rng_state()
    plugin_state = engine.plugins.checkpoint_state(rank)
    if plugin_state:
        state[f"plugins.rank{rank}"] = copy.deepcopy(plugin_state)
    state["meta"] = {
        "format": FORMAT,
        "world_size": engine.mesh.world_size,
        "degrees": dict(engine.mesh.degrees),
        "model": engine.config.model.model_dump(mode="json"),
        "dp_strategy": engine.config.parallel.dp_strategy,
    }
    return state


def _plain_step(value: Any) -> float | int:
    if isinstance(value, torch.Tensor):
        return float(value.item())
    return value


def save_state_dict(state: dict[str, Any], directory: Path, *, process_group: Any) -> None:
    """Write a flat state dict with DCP (one file per writing rank, fsynced)."""
    dcp.save(
        state,
        storage_writer=dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True),
        planner=ChunkSavePlanner(),
        process_group=process_group,
    )


@dataclass(frozen=True, slots=True)
class LoadReport:
    path: Path
    step: int
    model_only: bool
    notes: tuple[str, ...] = ()


def load_engine_state(
    engine: Any,
    directory: Path,
    *,
    batches: Any = None,
    process_group: Any = None,
    model_only: bool = False,
) -> LoadReport:
    """Load a checkpoint into a (possibly differently sharded) engine, in place.

    With `model_only`, or when the checkpoint holds weights only (e.g. imported from Hugging
    Face), the optimizer, scheduler, sampler and step are left as they are. Such a weights-only
    load of a layout with entries checkpoints leave out (`StateLayout.left_out`: a LoRA job's
    frozen base) fills those, every one required, and the saved entries the checkpoint holds (a
    base's checkpoint holds no adapters: they keep their init); then the layout is told where the
    left-out entries came from (`StateLayout.after_left_out_load`). Every other load fills the
    saved entries, every one required, and never the left-out ones.
    """
    reader = dcp.FileSystemReader(directory)
    saved = reader.read_metadata().state_dict_metadata
    model_only = model_only or "train.step" not in saved
    if not model_only:
        # A job that has not stepped yet holds no optimizer state: make some to load into.
        ensure_optimizer_state(engine.optimizer)
    layout = layout_for(engine)
    rank = engine.mesh.rank
    state: dict[str, Any] = {}
    entries = layout.by_name()
    left_out = layout.left_out_by_name() if model_only else {}
    required = left_out or entries
    missing = [fqn for fqn in required if model_key(fqn) not in saved]
    if missing:
        raise CheckpointError(
            f"{directory} has no weights for {len(missing)} parameter(s) of this model, e.g. "
            f"{missing[:3]}; it holds {sum(k.startswith('model.') for k in saved)} parameters"
        )
    if left_out:
        held = {fqn: entry for fqn, entry in entries.items() if model_key(fqn) in saved}
        weights = {**held, **left_out}
    else:
        weights = entries
    staging = Staging()
    for fqn, entry in weights.items():
        state[model_key(fqn)] = ChunkedValue(tensor_pieces(entry.value, staging=staging))
    steps: dict[str, Any] = {}
    if not model_only:
        for fqn, entry in entries.items():
            for entry_key, tensor in entry.optimizer_state.items():
                key = optim_key(fqn, entry_key)
                if key in saved:
                    state[key] = ChunkedValue(tensor_pieces(tensor, staging=staging))
            if entry.step is not None and optim_key(fqn, "step") in saved:
                steps[fqn] = state[optim_key(fqn, "step")] = None
        for key in ("optim.param_groups", "lr_scheduler", "sampler", "train.step", "meta"):
            if key in saved:
                state[key] = None
        for prefix in ("rng", "plugins"):
            own = f"{prefix}.rank{rank}"
            if own in saved:
                state[own] = None
            elif f"{prefix}.rank0" in saved:
                state[f"{prefix}.rank0"] = None
    dcp.load(state, storage_reader=reader, planner=ChunkLoadPlanner(), process_group=process_group)
    staging.write_back()
    notes: list[str] = []
    if model_only:
        layout.finish_load()
        if left_out:
            read = partial(_read_whole, directory, saved)
            layout.finish_left_out_load(LoadedFrom(str(directory), read))
        return LoadReport(directory, int(engine.global_step), True)
    _set_optimizer_steps(layout, {fqn: state[optim_key(fqn, "step")] for fqn in steps})
    layout.finish_load()
    _apply_training_state(engine, state, batches=batches, rank=rank, notes=notes)
    return LoadReport(directory, int(engine.global_step), False, tuple(notes))


def _read_whole(
    directory: Path, saved: dict[str, Any], dtypes: Mapping[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """Weights of the checkpoint at `directory`, whole, by name, in the dtypes asked: read by
    this rank alone (no collective), whichever ranks wrote them."""
    state: dict[str, Any] = {}
    whole: dict[str, torch.Tensor] = {}
    for fqn, dtype in dtypes.items():
        whole[fqn] = torch.empty(saved[model_key(fqn)].size, dtype=dtype)
        state[model_key(fqn)] = ChunkedValue(TensorPieces.whole(whole[fqn]))
    with warnings.catch_warnings():
        # NOTE: DCP warns that it reads in one process: which it is asked to do here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            state,
            storage_reader=dcp.FileSystemReader(directory),
            planner=ChunkLoadPlanner(),
            no_dist=True,
        )
    return whole


def _set_optimizer_steps(layout: StateLayout, steps: dict[str, Any]) -> None:
    entries = layout.by_name()
    for fqn, step in steps.items():
        counter = entries[fqn].step
        if counter is not None:
            counter.set(step)


def _apply_training_state(
    engine: Any, state: dict[str, Any], *, batches: Any, rank: int, notes: list[str]
) -> None:
    apply_schedule(
        engine, param_groups=state.get("optim.param_groups"), lr_scheduler=state.get("lr_scheduler")
    )
    if batches is not None and state.get("sampler") is not None:
        batches.load_state_dict(state["sampler"])
    engine.global_step = int(state["train.step"])
    rng = state.get(f"rng.rank{rank}")
    if rng is None and state.get("rng.rank0") is not None:
        rng = state["rng.rank0"]
        notes.append(f"no RNG state saved for rank {rank} (a smaller job saved): using rank 0's")
    if rng is not None:
        set_rng_state(rng)
    plugin_state = state.get(f"plugins.rank{rank}", state.get("plugins.rank0"))
    if plugin_state:
        for entry in plugin_state if isinstance(plugin_state, list) else [plugin_state]:
            engine.plugins.load_checkpoint_state(entry)
