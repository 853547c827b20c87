"""The canonical checkpoint layout, and the protocol parallel runtimes implement to map onto it.

A checkpoint stores every tensor under its *original* fully-qualified name (the name it has in the
unsharded model, wrapper components stripped) with its *global* shape, as a set of rectangular
chunks. Whatever a rank holds — a whole replicated parameter, a tensor-parallel slice, a flat
ZeRO shard, the layers of one pipeline stage — is described as `TensorPieces`: the global shape
and the local chunks with their offsets. Saving writes those chunks; loading reads whichever
saved chunks overlap the chunks this rank holds, so any layout loads any other (resharding).

A runtime that holds model or optimizer state in a layout other than "the module's parameters,
replicated" implements `checkpoint_layout()` returning a `StateLayout`; the built-in
runtimes are described by adapters that read their public attributes: `placements` (pipeline
chunk names, tensor-parallel blocks) and `layouts_zero` (flat ZeRO shards).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from plait.plugins.models.init import normalised_name

# Optimizer state entries that have the parameter's shape (and are sharded like it).
TENSOR_STATE_KEYS: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "momentum_buffer")


@dataclass(frozen=True, slots=True)
class TensorChunk:
    """A rectangular block of a global tensor: `tensor` holds rows `offsets[i]:+tensor.shape[i]`.

    `tensor` is the rank's own storage (a view), so loading writes into it in place.
    """

    offsets: tuple[int, ...]
    tensor: torch.Tensor


@dataclass(slots=True)
class TensorPieces:
    """What one rank holds of one named global tensor (possibly nothing, possibly all of it)."""

    global_shape: torch.Size
    chunks: list[TensorChunk] = field(default_factory=list)

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> TensorPieces:
        """A tensor this rank holds entirely — or, for a DTensor, its local shard."""
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offsets = compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements
            )
            local = tensor.to_local()
            return cls(tensor.shape, [TensorChunk(tuple(offsets), local)] if local.numel() else [])
        return cls(tensor.shape, [TensorChunk((0,) * tensor.dim(), tensor)])

    def numel(self) -> int:
        return sum(c.tensor.numel() for c in self.chunks)

    def check(self, name: str) -> None:
        for chunk in self.chunks:
            shape = chunk.tensor.shape
            if len(chunk.offsets) != len(self.global_shape) or any(
                o < 0 or o + s > g
                for o, s, g in zip(chunk.offsets, shape, self.global_shape, strict=True)
            ):
                raise ValueError(
                    f"{name}: chunk at offsets {chunk.offsets} with shape {tuple(shape)} does not "
                    f"fit the global shape {tuple(self.global_shape)}"
                )


def flat_range_chunks(
    flat: torch.Tensor, start: int, global_shape: torch.Size | tuple[int, ...]
) -> list[TensorChunk]:
    """Describe `flat` — elements `[start, start + flat.numel())` of the row-major flattening of a
    tensor of `global_shape` — as rectangular chunks viewing `flat`.

    A contiguous range of a 2-D tensor is a partial first row, a block of full rows and a partial
    last row (at most three chunks); an N-D tensor needs at most 2N - 1. Each chunk is a view of
    `flat`, so reading into the chunks fills the flat shard in place.
    """
    shape = tuple(global_shape)
    total = math.prod(shape)
    end = start + flat.numel()
    if start < 0 or end > total:
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of {total} elements")
    if flat.numel() == 0:
        return []
    if not shape:
        return [TensorChunk((), flat.view(()))]
    return [
        TensorChunk(o, flat[a - start : b - start].view(s))
        for o, s, a, b in _ranges(shape, start, end)
    ]


def _ranges(
    shape: tuple[int, ...], start: int, end: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """Yield (offsets, sizes, flat_start, flat_end) of rectangles covering [start, end)."""
    if len(shape) == 1:
        yield (start,), (end - start,), start, end
        return
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row
    if start % row or (first == last and end % row):
        # A partial row: recurse into that row's sub-tensor, then prefix the row index.
        stop = min(end, (first + 1) * row)
        for offsets, sizes, a, b in _ranges(shape[1:], start - first * row, stop - first * row):
            yield (first, *offsets), (1, *sizes), a + first * row, b + first * row
        start = stop
        if start >= end:
            return
        first = start // row
    full_rows_end = (end // row) * row
    if full_rows_end > start:
        rows = (full_rows_end - start) // row
        yield (first, *([0] * (len(shape) - 1))), (rows, *shape[1:]), start, full_rows_end
        start = full_rows_end
    if start < end:
        last = start // row
        for offsets, sizes, a, b in _ranges(shape[1:], 0, end - start):
            yield (last, *offsets), (1, *sizes), a + start, b + start


@runtime_checkable
class StateLayout(Protocol):
    """What a rank holds of the model and optimizer, by original FQN, in the canonical layout.

    - `model_pieces()`: FQN -> the pieces of that parameter this rank holds.
    - `optimizer_pieces()`: FQN -> {"exp_avg": TensorPieces, "exp_avg_sq": TensorPieces,
      "step": int | Tensor}; tensor entries have the parameter's global shape. On load, the
      layout must return storage to load into, creating empty state if the optimizer has not
      stepped yet (`create=True`).
    - `after_load()`: called once everything was read (e.g. re-gather ZeRO-3 parameters, copy
      fp32 master weights into the low-precision copies).
    - `set_step(fqn, step)`: restore the optimizer step count of one parameter.
    """

    def model_pieces(self) -> dict[str, TensorPieces]: ...

    def optimizer_pieces(self, create: bool = False) -> dict[str, dict[str, Any]]: ...

    def set_step(self, name: str, step: float | int) -> None: ...

    def after_load(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a rank's local parameters sit in the original model.

    `names`: id(parameter) -> original FQN, for runtimes that rename (pipeline chunks of a rank
    with virtual stages live under `chunks.stage<k>.`); others keep their module name, wrapper
    components stripped. `blocks`: id(parameter) -> (global shape, offsets) of a parameter that
    holds a rectangular block of a larger tensor (a tensor-parallel slice); others are whole.
    """

    names: dict[int, str] = field(default_factory=dict)
    blocks: dict[int, tuple[torch.Size, tuple[int, ...]]] = field(default_factory=dict)

    def name(self, param: torch.Tensor, local_name: str) -> str:
        return self.names.get(id(param)) or normalised_name(local_name)

    def block(
        self, param: torch.Tensor, local_shape: torch.Size | None = None
    ) -> tuple[torch.Size, tuple[int, ...]]:
        """(global shape, offsets of the local block) of `param`."""
        found = self.blocks.get(id(param))
        if found is not None:
            return found
        shape = torch.Size(local_shape if local_shape is not None else param.shape)
        return shape, (0,) * len(shape)

    def whole(self, param: torch.Tensor, local: torch.Tensor) -> TensorPieces:
        """`local` (the parameter's local values, or state shaped like them) as global pieces."""
        global_shape, offsets = self.block(param, local.shape)
        return TensorPieces(global_shape, [TensorChunk(offsets, local)])

    def flat_range(
        self, param: torch.Tensor, flat: torch.Tensor, start: int, local_shape: torch.Size
    ) -> list[TensorChunk]:
        """Chunks of `flat`, elements `[start, start + flat.numel())` of the flattened local
        parameter, in global coordinates: a rectangle of the local block, shifted by its
        offsets, is a rectangle of the global tensor."""
        _, offsets = self.block(param, local_shape)
        chunks = flat_range_chunks(flat, start, local_shape)
        if not any(offsets):
            return chunks
        return [
            TensorChunk(tuple(o + b for o, b in zip(c.offsets, offsets, strict=True)), c.tensor)
            for c in chunks
        ]


class ReplicatedLayout:
    """The layout of a module whose parameters are whole on every rank that holds them (plain,
    DDP, pipeline stages), or tensor-parallel blocks as `placement` says.

    Chunks several ranks hold identically (replicas) are written once: DCP's planner deduplicates
    identical write items across ranks. Optimizer state is read from `optimizer.state[param]`.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        placement: Placement | None = None,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.placement = placement or Placement()
        self.params: dict[str, nn.Parameter] = {}
        for name, param in module.named_parameters():
            self.params.setdefault(self.placement.name(param, name), param)

    def model_pieces(self) -> dict[str, TensorPieces]:
        return {name: self.placement.whole(p, p.detach()) for name, p in self.params.items()}

    def optimizer_pieces(self, create: bool = False) -> dict[str, dict[str, Any]]:
        if self.optimizer is None:
            return {}
        pieces: dict[str, dict[str, Any]] = {}
        for name, param in self.params.items():
            state = self.optimizer.state.get(param)
            if not state:
                if not create or not param.requires_grad:
                    continue
                state = self.optimizer.state[param] = empty_adam_state(self.optimizer, param)
            entry: dict[str, Any] = {}
            for key, value in state.items():
                if key in TENSOR_STATE_KEYS and isinstance(value, torch.Tensor):
                    entry[key] = self.placement.whole(param, value)
                elif key == "step":
                    entry[key] = value
            pieces[name] = entry
        return pieces

    def set_step(self, name: str, step: float | int) -> None:
        """Restore a step count in the optimizer's own convention (int or 0-d tensor)."""
        if self.optimizer is None or self.params[name] not in self.optimizer.state:
            return
        set_step_count(self.optimizer.state[self.params[name]], step)

    def after_load(self) -> None:
        pass


def set_step_count(state: dict[str, Any], step: float | int) -> None:
    """Store `step` in `state` the way the optimizer keeps it (Python int or 0-d tensor)."""
    current = state.get("step")
    if isinstance(current, torch.Tensor):
        state["step"] = torch.tensor(float(step), dtype=current.dtype, device=current.device)
    else:
        state["step"] = int(step)


def empty_adam_state(optimizer: torch.optim.Optimizer, like: torch.Tensor) -> dict[str, Any]:
    """Adam state for a parameter that has not stepped yet, to load a checkpoint into.

    plait's AdamW counts steps in a Python int; torch's optimizers keep a 0-d float tensor.
    """
    from plait.core.optim import AdamW

    step: Any = 0 if isinstance(optimizer, AdamW) else torch.tensor(0.0)
    return {
        "step": step,
        "exp_avg": torch.zeros_like(like, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(like, memory_format=torch.preserve_format),
    }


def layout_for(engine: Any) -> StateLayout:
    """The layout of an engine.

    A runtime may describe its own (`checkpoint_layout()`, data parallel asked first). Otherwise
    the built-in runtimes are read here: the pipeline's chunks give original names, tensor
    parallelism the blocks its slices hold, and a ZeRO runtime the flat shards that hold the
    weights and optimizer state; without ZeRO, the module's parameters hold them.
    """
    for runtime in reversed(engine.runtimes):
        describe = getattr(runtime, "checkpoint_layout", None)
        if describe is not None:
            layout = describe()
            if layout is not None:
                return layout
    from plait.plugins.checkpoint.layouts_zero import zero_layout
    from plait.plugins.checkpoint.placements import pipeline_names, tensor_parallel_blocks

    names: dict[int, str] = {}
    blocks: dict[int, tuple[torch.Size, tuple[int, ...]]] = {}
    for runtime in engine.runtimes:
        names.update(pipeline_names(runtime))
        blocks.update(tensor_parallel_blocks(runtime, engine.module))
    placement = Placement(names=names, blocks=blocks)
    for runtime in reversed(engine.runtimes):
        layout = zero_layout(runtime, engine.module, engine.optimizer, placement)
        if layout is not None:
            return layout
    return ReplicatedLayout(engine.module, engine.optimizer, placement)
