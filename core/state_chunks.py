"""The chunks of declared state that checkpoints and weight exports write and read.

A checkpoint stores every tensor under its *original* name (`plait.core.names`) with its *global*
shape, as a set of rectangular chunks. What a rank holds — a whole replicated parameter, a
tensor-parallel slice, a flat ZeRO shard, the layers of one pipeline stage, or whatever a
third-party strategy keeps — is read from the engine's `plait.core.state_layout.StateLayout`
(each runtime's `state_layout()`), never from the strategies' classes, and turned into
`TensorPieces`: the global shape and this rank's chunks with their offsets. Saving writes those
chunks; loading reads whichever saved chunks overlap them, so any layout loads any other.

Shared by the checkpoint plugin (`plait.plugins.checkpoint`) and the Hugging Face interop
(`plait.plugins.huggingface`); `plait.core.dcp_planner` has DCP write and read them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.core.state_layout import LocalPiece, Region, StateLayout, TensorLayout, describe_state


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


def region_chunks(region: Region, storage: torch.Tensor) -> list[TensorChunk]:
    """`storage` (a piece of `region`: the block, or the flat range) as chunks viewing it."""
    if region.flat is None:
        return [TensorChunk(region.offsets, storage.view(region.sizes))]
    flat = storage.view(-1)  # a view, so loading fills the rank's storage in place
    return [
        TensorChunk(r.offsets, flat[r.start : r.stop].view(r.sizes)) for r in region.rectangles()
    ]


def flat_range_chunks(
    flat: torch.Tensor, start: int, global_shape: torch.Size | tuple[int, ...]
) -> list[TensorChunk]:
    """`flat` — elements `[start, start + flat.numel())` of the row-major flattening of a tensor
    of `global_shape` — as rectangular chunks viewing `flat` (at most 2·ndim − 1)."""
    shape = tuple(global_shape)
    total = math.prod(shape)
    if start < 0 or start + flat.numel() > total:
        raise ValueError(
            f"flat range [{start}, {start + flat.numel()}) is outside a tensor of {total} elements"
        )
    return region_chunks(Region.whole(shape).flat_range(start, start + flat.numel()), flat)


@dataclass(slots=True)
class Staging:
    """Pieces reached through getter/setter callables are loaded into copies, then set."""

    pending: list[tuple[LocalPiece, torch.Tensor]] = field(default_factory=list)

    def storage(self, piece: LocalPiece) -> torch.Tensor:
        if piece.tensor is not None:
            return piece.tensor
        copy = piece.read().detach().clone()
        self.pending.append((piece, copy))
        return copy

    def write_back(self) -> None:
        for piece, value in self.pending:
            piece.write(value)
        self.pending.clear()


def tensor_pieces(
    tensor: TensorLayout,
    *,
    staging: Staging | None = None,
    is_writer: Callable[[tuple[str, ...]], bool] | None = None,
) -> TensorPieces:
    """The chunks of a declared tensor. Saving (`is_writer` given): a replicated tensor is
    written by the first rank along its replication axes only. Loading (`staging` given):
    chunks are the storage to load into."""
    pieces = TensorPieces(torch.Size(tensor.global_shape))
    if is_writer is not None and not is_writer(tensor.replicated_over):
        return pieces
    for piece in tensor.pieces:
        storage = staging.storage(piece) if staging is not None else piece.read()
        pieces.chunks.extend(region_chunks(piece.region, storage))
    return pieces


def first_replica(engine: Any) -> Callable[[tuple[str, ...]], bool]:
    """Whether this rank is the first along every given mesh axis (it writes replicated data)."""
    coordinates = engine.mesh.coordinates()
    return lambda axes: all(coordinates.get(axis, 0) == 0 for axis in axes)


def layout_for(engine: Any) -> StateLayout:
    """The engine's state as its strategies declare it, the data parallel one last."""
    return describe_state(engine.module, engine.optimizer, engine.runtimes, engine.mesh)
