"""Where groups of different inner layouts average their gradients: a split of the global
gradients that does not depend on any layout.

The quorum's all-reduce adds rank i's buffer of every group element by element, so it needs the
gradients the optimizers step on laid out alike on rank i of every group: true when the groups
share a layout (the direct path in `commit`), not when one runs ZeRO-1 and another ZeRO-3 (rank
i holds other parameters' ranges). Then each group moves its gradients into the *canonical
split* — every parameter by global name, in name order, row-major, laid end to end and cut into
as many equal ranges as the group has ranks — averages range i across the groups on rank i, and
moves the averages back into its own layout. Both moves are one all-to-all inside the group
(`chunk_exchange`), planned once. The additions are the same as on the direct path (one sum per
element across the groups, then the division), so the result is the same.

Which path a step takes must be the same in every group: each group's *layout digest* (the
global regions its ranks' optimizer gradients hold, in order) is compared across the quorum
whenever the quorum changes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from plait.core.comm import Group
from plait.core.comm_algorithms import GRAD_SPLIT
from plait.core.errors import PlaitError
from plait.core.state_chunks import TensorChunk, first_replica, layout_for, region_chunks
from plait.core.state_layout import Region
from plait.plugins.fault_tolerance.chunk_exchange import ExchangePlan, plan_exchange


class GradientLayoutError(PlaitError):
    """The strategy's state layout does not say where the optimizer's gradients lie."""


@dataclass(frozen=True, slots=True)
class _GradientPiece:
    """A piece of one optimizer parameter's gradient: the same view of `.grad` that the state
    layout's value piece is of the parameter."""

    name: str  # global parameter name
    region: Region
    param: int  # index among the optimizer's parameters
    offset: int  # storage offset from the parameter's own
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    sends: bool  # the first replica along the tensor's replication axes


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _gradient_pieces(engine: Any) -> tuple[list[_GradientPiece], dict[str, tuple[int, ...]]]:
    """This rank's gradient pieces, in the optimizer's order, and the global shapes of the
    parameters they belong to."""
    params = _optimizer_params(engine.optimizer)
    by_storage: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for index, param in enumerate(params):
        by_storage.setdefault(param.untyped_storage().data_ptr(), []).append((index, param))
    sends = first_replica(engine)
    pieces = []
    shapes: dict[str, tuple[int, ...]] = {}
    for name, entry in layout_for(engine).by_name().items():
        for piece in entry.value.pieces:
            if piece.tensor is None:
                raise GradientLayoutError(
                    f"{name}: its value is read through a getter, so its gradient cannot be "
                    "found; groups of different layouts cannot average it"
                )
            at = piece.tensor.storage_offset()
            candidates = by_storage.get(piece.tensor.untyped_storage().data_ptr(), [])
            owner = next(
                (
                    (index, param)
                    for index, param in candidates
                    if param.storage_offset() <= at < param.storage_offset() + param.numel()
                ),
                None,
            )
            if owner is None:
                continue  # frozen: no optimizer parameter, no gradient
            index, param = owner
            shapes[name] = tuple(entry.value.global_shape)
            pieces.append(
                _GradientPiece(
                    name=name,
                    region=piece.region,
                    param=index,
                    offset=piece.tensor.storage_offset() - param.storage_offset(),
                    shape=tuple(piece.tensor.shape),
                    stride=tuple(piece.tensor.stride()),
                    sends=sends(entry.value.replicated_over),
                )
            )
    # The optimizer's order: what the direct path's flat buffer follows.
    pieces.sort(key=lambda p: (p.param, p.offset))
    return pieces, shapes


def _digest(pieces: list[_GradientPiece], params: list[torch.Tensor]) -> tuple[Any, ...]:
    """What must match between rank i of two groups for their flat gradients to line up."""
    return (
        tuple(p.numel() for p in params),
        tuple((p.name, p.region, p.param, p.offset, p.shape) for p in pieces),
    )


class GradientSplit:
    """This rank's gradients as chunks of global tensors, and the two moves to and from the
    canonical split; made once per engine (collective over the group)."""

    def __init__(self, engine: Any, *, group: Group) -> None:
        self.engine = engine
        self.group = group
        self.pieces, shapes = _gradient_pieces(engine)
        params = _optimizer_params(engine.optimizer)
        gathered: list[Any] = [None] * group.size
        dist.all_gather_object(
            gathered, (_digest(self.pieces, params), shapes), group=group.process_group
        )
        self.fingerprint = _fingerprint(tuple(digest for digest, _ in gathered))
        self.global_shapes: dict[str, tuple[int, ...]] = {}
        for _, rank_shapes in gathered:
            self.global_shapes.update(rank_shapes)
        self.dtype = params[0].dtype if params else torch.float32
        self._to_canonical: ExchangePlan | None = None
        self._from_canonical: ExchangePlan | None = None
        self._canonical_regions: list[tuple[str, Region, int, int]] = []

    def _gradient_chunks(self, *, senders_only: bool) -> dict[str, list[TensorChunk]]:
        params = _optimizer_params(self.engine.optimizer)
        chunks: dict[str, list[TensorChunk]] = {}
        for piece in self.pieces:
            if senders_only and not piece.sends:
                continue
            param = params[piece.param]
            grad = param.grad
            if grad is None or grad.stride() != param.stride():
                raise GradientLayoutError(
                    f"{piece.name}: the optimizer's gradient is missing or not laid out like "
                    "its parameter"
                )
            view = grad.as_strided(piece.shape, piece.stride, grad.storage_offset() + piece.offset)
            chunks.setdefault(piece.name, []).extend(region_chunks(piece.region, view))
        return chunks

    def _canonical_chunks(self, buffer: torch.Tensor) -> dict[str, list[TensorChunk]]:
        chunks: dict[str, list[TensorChunk]] = {}
        for name, region, start, stop in self._canonical_regions:
            chunks.setdefault(name, []).extend(region_chunks(region, buffer[start:stop]))
        return chunks

    def _plan(self) -> None:
        names = sorted(self.global_shapes)
        sizes = [torch.Size(self.global_shapes[n]).numel() for n in names]
        total = sum(sizes)
        me = self.group.rank_of(dist.get_rank())
        low, high = total * me // self.group.size, total * (me + 1) // self.group.size
        start = 0
        for name, size in zip(names, sizes, strict=True):
            a, b = max(low, start), min(high, start + size)
            if a < b:
                region = Region.whole(self.global_shapes[name]).flat_range(a - start, b - start)
                self._canonical_regions.append((name, region, a - low, b - low))
            start += size
        self._canonical_numel = high - low
        buffer = torch.empty(self._canonical_numel, dtype=self.dtype)
        canonical = self._canonical_chunks(buffer)
        self._to_canonical = plan_exchange(
            self._gradient_chunks(senders_only=True), canonical, group=self.group
        )
        self._from_canonical = plan_exchange(
            canonical, self._gradient_chunks(senders_only=False), group=self.group
        )

    def average(self, all_reduce_mean: Any) -> None:
        """Average the optimizer's gradients across the groups through the canonical split:
        `all_reduce_mean(buffer)` averages this rank's range with rank i of the other groups."""
        if self._to_canonical is None:
            self._plan()
        assert self._to_canonical is not None and self._from_canonical is not None
        device, comm = self.engine.device, self.engine.comm
        buffer = torch.zeros(self._canonical_numel, dtype=self.dtype, device=device)
        canonical = self._canonical_chunks(buffer)
        self._to_canonical.run(
            self._gradient_chunks(senders_only=True),
            canonical,
            comm=comm,
            device=device,
            purpose=GRAD_SPLIT,
        )
        all_reduce_mean(buffer)
        self._from_canonical.run(
            canonical,
            self._gradient_chunks(senders_only=False),
            comm=comm,
            device=device,
            purpose=GRAD_SPLIT,
        )


def _fingerprint(digests: tuple[Any, ...]) -> tuple[int, int]:
    """Two 20-bit numbers from the group's digests: small enough that sums of their squares
    over a quorum are exact in float64."""
    digest = hashlib.sha256(repr(digests).encode()).digest()
    return (
        int.from_bytes(digest[:4], "big") % (1 << 20),
        int.from_bytes(digest[4:8], "big") % (1 << 20),
    )
