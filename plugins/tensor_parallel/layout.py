"""How Megatron tensor parallelism holds parameters, for `ParallelRuntime.state_layout`.

The layers of `layers` keep this rank's contiguous 1/tp of a weight along one dim and tag it
with `TP_DIM_ATTR`: a column-parallel weight (and its bias) and a vocab-parallel embedding split
their output dim (0 for `nn.Linear`, 1 for a `Conv1D`), a row-parallel weight its input dim,
loose `param_plan` parameters dim 0. Each such slice is the block at offset
`tp_rank · local_size` along that dim (`layers.even_slice`) of a tensor `tp` times as long,
sharded over `tp`; its optimizer state is sliced the same way. A fused projection's shard
(`TP_PARTS_ATTR`: GPT-2's q | k | v) is that many such blocks side by side, one per part, each
described as its own piece. Everything else stays whole and replicated over `tp`: norms, the
row-parallel bias, and grouped-query KV projections replicated because tp exceeds the KV head
count (`ReplicatedHeadsLinear` holds the full weight).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from plait.core.state_layout import (
    LocalPiece,
    ParameterLayout,
    Region,
    StateLayout,
    TensorLayout,
)
from plait.plugins.tensor_parallel.layers import TP_DIM_ATTR, TP_PARTS_ATTR

TP_AXIS = "tp"


def tensor_parallel_layout(previous: StateLayout, *, size: int, rank: int) -> StateLayout:
    """`previous` with every tp slice placed in its global tensor."""

    def refine(entry: ParameterLayout) -> ParameterLayout:
        dim = getattr(entry.param, TP_DIM_ATTR, None)
        if dim is None:
            return entry
        parts = getattr(entry.param, TP_PARTS_ATTR, 1)
        local = entry.value.global_shape
        global_shape = list(local)
        global_shape[dim] = local[dim] * size
        if parts > 1:
            return entry.map_tensors(
                lambda t: _place_parts(t, dim, parts, global_shape=global_shape, rank=rank)
            )
        offsets = [0] * len(local)
        offsets[dim] = rank * local[dim]
        return entry.map_tensors(
            lambda t: t.sharded_along(TP_AXIS, global_shape=global_shape, offsets=offsets)
        )

    return previous.map(refine)


def _place_parts(
    tensor: TensorLayout, dim: int, parts: int, *, global_shape: list[int], rank: int
) -> TensorLayout:
    """A fused shard (one whole piece) as `parts` pieces: local part `i` is the block at
    `i · global_part + rank · local_part` along `dim` of the global tensor."""
    if len(tensor.pieces) != 1 or tensor.pieces[0].region.flat is not None:
        raise ValueError(
            f"a fused tensor-parallel shard is placed from one whole piece; it was declared as "
            f"{len(tensor.pieces)} piece(s)"
        )
    (piece,) = tensor.pieces
    local_part = piece.region.sizes[dim] // parts
    global_part = global_shape[dim] // parts
    pieces = []
    for part in range(parts):
        offsets = [0] * len(global_shape)
        offsets[dim] = part * global_part + rank * local_part
        region = Region(tuple(offsets), piece.region.narrow(dim, 0, local_part).sizes)
        pieces.append(_part_of(piece, region, dim, part * local_part, local_part))
    return replace(
        tensor,
        global_shape=torch.Size(global_shape),
        pieces=tuple(pieces),
        sharded_over=(*tensor.sharded_over, TP_AXIS),
        replicated_over=tuple(a for a in tensor.replicated_over if a != TP_AXIS),
    )


def _part_of(piece: LocalPiece, region: Region, dim: int, start: int, length: int) -> LocalPiece:
    """Rows `start:start + length` along `dim` of `piece`: a view when contiguous (dim 0), else
    read and written through copies (a `Conv1D` weight splits its columns)."""
    if piece.tensor is not None:
        view = piece.tensor.narrow(dim, start, length)
        if view.is_contiguous():
            return LocalPiece(region, tensor=view)
    whole = piece.read

    def get() -> torch.Tensor:
        return whole().narrow(dim, start, length).contiguous()

    def put(value: torch.Tensor) -> None:
        full = whole().detach().clone()
        full.narrow(dim, start, length).copy_(value.view(region.sizes))
        piece.write(full)

    return LocalPiece(region, get=get, set=put)
