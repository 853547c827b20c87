"""Hand the ranks of one group the parts of global tensors that other ranks of it hold.

A group that heals from a peer with another inner layout receives, on each rank, whatever the
peer's rank of the same group rank held (torchft's transport pairs equal group ranks): chunks of
global tensors with their offsets, not what this rank's own layout needs. `exchange_chunks`
routes them: every rank says what it holds and what it wants (offsets and shapes only), every
rank computes the same plan of overlaps from that, and one all-to-all of bytes carries each
overlap from the rank that holds it to the rank that wants it. A wanted chunk that the group's
held chunks do not cover exactly is an error, never a silently partial load.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.core.comm import Comm, Group
from plait.core.errors import PlaitError
from plait.core.state_chunks import TensorChunk


class ExchangeError(PlaitError):
    """The chunks the group holds do not cover what one of its ranks needs."""


# Per key, (offsets, shape, dtype name) of each chunk, in the order the rank lists them.
ChunkShapes = dict[str, list[tuple[tuple[int, ...], tuple[int, ...], str]]]


@dataclass(frozen=True, slots=True)
class _Overlap:
    key: str
    held: int  # index of the chunk among the sender's held chunks of `key`
    wanted: int  # index of the chunk among the receiver's wanted chunks of `key`
    offsets: tuple[int, ...]  # the overlap, in global coordinates
    sizes: tuple[int, ...]
    dtype: torch.dtype  # the held chunk's: what travels

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def chunk_shapes(chunks: Mapping[str, Sequence[TensorChunk]]) -> ChunkShapes:
    """What the plan needs of some chunks: their offsets, shapes and dtypes, by key."""
    return {
        key: [(tuple(c.offsets), tuple(c.tensor.shape), str(c.tensor.dtype)) for c in listed]
        for key, listed in chunks.items()
    }


def _overlap(
    a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    starts = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    stops = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(stop <= start for start, stop in zip(starts, stops, strict=True)):
        return None
    return starts, tuple(stop - start for start, stop in zip(starts, stops, strict=True))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ExchangeError(f"a held chunk has an unknown dtype {name!r}")
    return dtype


def plan_overlaps(held: ChunkShapes, wanted: ChunkShapes) -> list[_Overlap]:
    """Every overlap of a chunk `held` by one rank with a chunk `wanted` by another, in one
    order that both ranks compute alike (sorted keys, then held, then wanted index)."""
    overlaps = []
    for key in sorted(held.keys() & wanted.keys()):
        for h, (h_offsets, h_shape, dtype) in enumerate(held[key]):
            for w, (w_offsets, w_shape, _) in enumerate(wanted[key]):
                if len(h_offsets) != len(w_offsets):
                    raise ExchangeError(
                        f"{key}: a held chunk has {len(h_offsets)} dims, a wanted one "
                        f"{len(w_offsets)}"
                    )
                box = _overlap((h_offsets, h_shape), (w_offsets, w_shape))
                if box is not None:
                    overlaps.append(_Overlap(key, h, w, box[0], box[1], _dtype(dtype)))
    return overlaps


def _cut(chunk: TensorChunk, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The part of `chunk` at global `offsets` with `sizes` (a view)."""
    view = chunk.tensor
    for dim, (start, size, origin) in enumerate(zip(offsets, sizes, chunk.offsets, strict=True)):
        view = view.narrow(dim, start - origin, size)
    return view


@dataclass(frozen=True, slots=True)
class ExchangePlan:
    """Which overlaps one rank sends to and receives from each rank of its group; made once
    (`plan_exchange`, collective) and run as often as the chunks' shapes stay the same."""

    group: Group
    outgoing: tuple[tuple[_Overlap, ...], ...]  # by destination group rank
    incoming: tuple[tuple[_Overlap, ...], ...]  # by source group rank

    @property
    def received_bytes(self) -> int:
        return sum(o.nbytes for overlaps in self.incoming for o in overlaps)

    def run(
        self,
        held: Mapping[str, Sequence[TensorChunk]],
        wanted: Mapping[str, Sequence[TensorChunk]],
        *,
        comm: Comm,
        device: torch.device,
        purpose: str,
    ) -> None:
        """Fill `wanted` from `held` (chunks of the shapes the plan was made for); collective
        over the plan's group: one all-to-all of bytes."""
        outgoing = []
        for overlaps in self.outgoing:
            parts = [
                _cut(held[o.key][o.held], o.offsets, o.sizes)
                .contiguous()
                .view(-1)
                .view(torch.uint8)
                for o in overlaps
            ]
            outgoing.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8))
        send_sizes = [t.numel() for t in outgoing]
        receive_sizes = [sum(o.nbytes for o in overlaps) for overlaps in self.incoming]
        send = torch.cat(outgoing).to(device)
        receive = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=device)
        comm.all_to_all(
            receive,
            send,
            group=self.group,
            input_split_sizes=send_sizes,
            output_split_sizes=receive_sizes,
            purpose=purpose,
        )
        position = 0
        for overlaps in self.incoming:
            for o in overlaps:
                part = receive[position : position + o.nbytes]
                if position % o.dtype.itemsize:
                    part = part.clone()  # a dtype view needs an aligned start
                part = part.view(o.dtype).view(o.sizes)
                position += o.nbytes
                _cut(wanted[o.key][o.wanted], o.offsets, o.sizes).copy_(part)


def plan_exchange(
    held: Mapping[str, Sequence[TensorChunk]],
    wanted: Mapping[str, Sequence[TensorChunk]],
    *,
    group: Group,
) -> ExchangePlan:
    """The plan that fills every chunk of `wanted` (this rank's) from the chunks the ranks of
    `group` hold; collective over `group`. Held chunks of different ranks must not overlap (a
    replicated tensor is held by one rank); a wanted chunk they do not cover is an error."""
    shapes: list[tuple[ChunkShapes, ChunkShapes] | None] = [None] * group.size
    # Offsets and shapes only: the plan's input, small beside the tensors.
    dist.all_gather_object(
        shapes, (chunk_shapes(held), chunk_shapes(wanted)), group=group.process_group
    )
    me = group.rank_of(dist.get_rank())
    held_by = [s[0] for s in shapes if s is not None]
    wanted_by = [s[1] for s in shapes if s is not None]
    incoming = tuple(tuple(plan_overlaps(held_by[src], wanted_by[me])) for src in range(group.size))
    check_coverage(wanted, incoming)
    outgoing = tuple(tuple(plan_overlaps(held_by[me], wanted_by[dst])) for dst in range(group.size))
    return ExchangePlan(group=group, outgoing=outgoing, incoming=incoming)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def exchange_chunks(
    held: Mapping[str, Sequence[TensorChunk]],
    wanted: Mapping[str, Sequence[TensorChunk]],
    *,
    comm: Comm,
    group: Group,
    device: torch.device,
    purpose: str,
) -> int:
    """Plan and run one exchange (see `plan_exchange`); the bytes this rank received."""
    exchange = plan_exchange(held, wanted, group=group)
    exchange.run(held, wanted, comm=comm, device=device, purpose=purpose)
    return exchange.received_bytes


def check_coverage(
    wanted: Mapping[str, Sequence[TensorChunk]], incoming: Sequence[Sequence[_Overlap]]
) -> None:
    """Every element of every wanted chunk arrives exactly once, or an `ExchangeError`."""
    covered: dict[tuple[str, int], int] = {}
    for overlaps in incoming:
        for o in overlaps:
            covered[(o.key, o.wanted)] = covered.get((o.key, o.wanted), 0) + o.numel
    for key, chunks in wanted.items():
        for index, chunk in enumerate(chunks):
            got = covered.get((key, index), 0)
            if got != chunk.tensor.numel():
                raise ExchangeError(
                    f"{key}: the group holds {got} of the {chunk.tensor.numel()} elements this "
                    f"rank needs at offsets {tuple(chunk.offsets)} (shape "
                    f"{tuple(chunk.tensor.shape)}); "
                    + ("some are missing" if got < chunk.tensor.numel() else "some twice")
                )
