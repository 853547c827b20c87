"""Flat, padded segments of parameters: the layout every ZeRO stage shards.

A `Segment` lays a list of parameters end to end in one flat buffer, padded to a multiple of the
data-parallel size, so rank `r` owns the contiguous chunk `[r·s, (r+1)·s)` whatever the
parameter counts are. Stage 1 and 2 use one segment per gradient bucket, stage 3 one per unit:
then one all-reduce, reduce-scatter or all-gather moves one whole segment, and its chunks line up
with the ranks' shards without any copy.

Inside a segment, matrices (`ndim >= 2`) come before vectors. A rank's chunk then splits into at
most two *runs*, and each run is handed to the optimizer as its own parameter, shaped `(1, n)`
for matrices and `(n,)` for vectors: an optimizer factory that decays only matrices (GPT/Llama
convention, plait's default `param_groups`) decays exactly the elements it would decay unsharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from plait.core.comm import Group


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one parameter lives in its segment."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    is_matrix: bool


@dataclass(frozen=True, slots=True)
class Run:
    """A stretch of this rank's chunk holding only matrices or only vectors (no padding)."""

    start: int  # offset inside the chunk
    numel: int
    is_matrix: bool


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of one parameter that falls into this rank's chunk."""

    slot: Slot
    param_start: int  # offset inside the flattened parameter
    chunk_start: int  # offset inside the chunk
    numel: int


class Segment:
    """Parameters laid out flat and padded to a multiple of `world_size`; rank `rank` owns one
    contiguous chunk of `chunk_numel` elements."""

    def __init__(
        self,
        index: int,
        named_params: Sequence[tuple[str, nn.Parameter]],
        *,
        world_size: int,
        rank: int,
        group: Group | None = None,
        padding_multiple: int | None = None,
    ) -> None:
        if not named_params:
            raise ValueError("a segment needs at least one parameter")
        kinds = {(p.dtype, p.device) for _, p in named_params}
        if len(kinds) > 1:
            raise ValueError(f"segment {index} mixes dtypes/devices: {sorted(map(str, kinds))}")
        if group is not None and group.size != world_size:
            raise ValueError(f"segment {index}: world_size {world_size} is not {group.name}'s size")
        # A multiple of world_size: chunks that split evenly once more (across HSDP replicas).
        multiple = padding_multiple or world_size
        if multiple % world_size:
            raise ValueError(f"segment {index}: padding {multiple} is no multiple of {world_size}")
        self.index = index
        # The group its gradients are reduced over and its chunks gathered over; None: the
        # runtime's data-parallel group (expert parameters have the expert-dp one).
        self.group = group
        self.world_size = world_size
        self.rank = rank
        ordered = sorted(named_params, key=lambda item: item[1].ndim < 2)  # stable
        slots, offset = [], 0
        for name, p in ordered:
            slots.append(Slot(name, p, offset, p.numel(), p.shape, p.ndim >= 2))
            offset += p.numel()
        self.slots: list[Slot] = slots
        self.numel = offset
        self.padded_numel = -(-offset // multiple) * multiple
        self.chunk_numel = self.padded_numel // world_size
        self.chunk_start = rank * self.chunk_numel
        self.dtype = ordered[0][1].dtype
        self.device = ordered[0][1].device

    @property
    def matrix_numel(self) -> int:
        return sum(s.numel for s in self.slots if s.is_matrix)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unsharded, padded) segment."""
        return self.padded_numel * torch.empty((), dtype=self.dtype).element_size()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of `flat` (the whole segment) per parameter, shaped like the parameter."""
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    def chunk_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a whole-segment buffer."""
        return flat[self.chunk_start : self.chunk_start + self.chunk_numel]

    def runs(self) -> list[Run]:
        """This rank's chunk split at the matrix/vector boundary, padding left out."""
        lo, hi = self.chunk_start, self.chunk_start + self.chunk_numel
        boundary = self.matrix_numel
        runs = []
        for start, end, is_matrix in ((0, boundary, True), (boundary, self.numel, False)):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                runs.append(Run(start=a - lo, numel=b - a, is_matrix=is_matrix))
        return runs

    def pieces(self) -> list[Piece]:
        """The parameters (or parts of them) inside this rank's chunk."""
        lo, hi = self.chunk_start, self.chunk_start + self.chunk_numel
        out = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append(Piece(slot=s, param_start=a - s.offset, chunk_start=a - lo, numel=b - a))
        return out

    def flatten(self, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Copy per-parameter `tensors` (in slot order) into the whole-segment buffer `out`,
        zeroing the padding."""
        for s, t in zip(self.slots, tensors, strict=True):
            out[s.offset : s.offset + s.numel].copy_(t.reshape(-1))
        out[self.numel :].zero_()
        return out

    def __repr__(self) -> str:
        return (
            f"Segment({self.index}, params={len(self.slots)}, numel={self.numel}, "
            f"padded={self.padded_numel}, chunk={self.chunk_numel})"
        )
