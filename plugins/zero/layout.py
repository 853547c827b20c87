"""How the ZeRO runtimes hold state, for `ParallelRuntime.state_layout`: flat ranges of shards.

Every stage keeps, per segment (`flat_buffer.Segment`), this rank's contiguous chunk of the
parameters laid end to end; `ShardedMaster` holds that chunk's fp32 master copy and hands the
optimizer one parameter per *run* of the chunk (matrices, then vectors). A `Piece` of the chunk
is a flat range of one parameter: described as that range of the parameter's block (the whole
parameter, or a tensor-parallel slice an earlier transform declared), so weights and optimizer
state reshard to and from any other layout. The same range of the run's state tensors
(`exp_avg`, `exp_avg_sq`, …) is the parameter's optimizer-state piece.

Weights are described by the fp32 masters: the truth when the model runs in lower precision.
After a load the masters are copied into the model's chunks and published: stages 1 and 2
all-gather the chunks into every rank's full flat buffers (the all-gather that follows an
optimizer step); stage 3 refreshes the units that are gathered and gathers the others from their
shards on the next forward. Frozen parameters are in no segment under stages 1 and 2: they keep
the earlier layout; stage 3 shards them in units of their own (`frozen_shard_layout`), with no
optimizer state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.core.comm import Comm
from plait.core.state_layout import (
    LocalPiece,
    ParameterLayout,
    StateLayout,
    StepCount,
    TensorLayout,
    set_step_count,
)
from plait.plugins.zero.flat_buffer import Piece, Run
from plait.plugins.zero.optimizer import ShardedMaster

if TYPE_CHECKING:
    from plait.plugins.zero.stage3 import Unit

DP_AXIS = "dp"


@dataclass(frozen=True, slots=True)
class _HeldPiece:
    segment: int
    piece: Piece
    run: Run | None
    run_param: nn.Parameter | None  # the optimizer's parameter for the run holding the piece


def _held_pieces(master: ShardedMaster) -> dict[int, list[_HeldPiece]]:
    """id(module parameter) -> the pieces of it in this rank's chunks (an empty list for a
    sharded parameter this rank holds nothing of)."""
    runs: dict[int, list[tuple[Run, nn.Parameter]]] = {}
    for segment_index, run, param in master.runs:
        runs.setdefault(segment_index, []).append((run, param))
    held: dict[int, list[_HeldPiece]] = {
        id(slot.param): [] for segment in master.segments for slot in segment.slots
    }
    for k, segment in enumerate(master.segments):
        for piece in segment.pieces():
            run, run_param = next(
                (
                    (r, p)
                    for r, p in runs.get(k, [])
                    if r.start <= piece.chunk_start < r.start + r.numel
                ),
                (None, None),
            )
            held[id(piece.slot.param)].append(_HeldPiece(k, piece, run, run_param))
    return held


def _sharded(
    previous: TensorLayout,
    pieces: tuple[LocalPiece, ...],
    axes: tuple[str, ...] = (DP_AXIS,),
    replica_axes: tuple[str, ...] = (),
) -> TensorLayout:
    """`axes`: the axes ZeRO shards over (dp, and cp under context parallelism; dp_shard
    instead of dp under HSDP, whose `replica_axes`, dp_replicate, hold identical copies: the
    first replica alone writes them to a checkpoint)."""
    split = (DP_AXIS,) if replica_axes else ()  # dp is described by its two sub-axes
    return replace(
        previous,
        pieces=pieces,
        sharded_over=tuple(dict.fromkeys((*previous.sharded_over, *axes))),
        replicated_over=tuple(
            dict.fromkeys(
                (*(a for a in previous.replicated_over if a not in (*axes, *split)), *replica_axes)
            )
        ),
    )


def _refine(
    entry: ParameterLayout, held: list[_HeldPiece], master: ShardedMaster
) -> ParameterLayout:
    if len(entry.value.pieces) != 1 or entry.value.pieces[0].region.flat is not None:
        raise ValueError(
            f"ZeRO shards {entry.name!r} as a flat range of one block, but an earlier transform "
            f"declared it as {len(entry.value.pieces)} piece(s)"
        )
    block = entry.value.pieces[0].region
    optimizer = master.optimizer
    values: list[LocalPiece] = []
    states: dict[str, list[LocalPiece]] = {}
    step_owners: list[dict[str, Any]] = []
    for h in held:
        piece = h.piece
        region = block.flat_range(piece.param_start, piece.param_start + piece.numel)
        flat = master.masters[h.segment][piece.chunk_start : piece.chunk_start + piece.numel]
        values.append(LocalPiece(region, tensor=flat))
        state = optimizer.state.get(h.run_param) if optimizer and h.run_param is not None else None
        if not state or h.run is None:
            continue
        start = piece.chunk_start - h.run.start
        step_owners.append(state)
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            if value.numel() != h.run.numel:
                continue  # not shaped like the run (a scalar or per-group statistic)
            flat_state = value.view(-1)[start : start + piece.numel]
            states.setdefault(key, []).append(LocalPiece(region, tensor=flat_state))
    step = None
    if step_owners and "step" in step_owners[0]:
        first = step_owners[0]

        def set_step(value: float | int) -> None:
            for state in step_owners:
                set_step_count(state, value)

        step = StepCount(get=lambda: first["step"], set=set_step)
    axes, replicas = master.shard_axes, master.replica_axes
    return replace(
        entry,
        value=_sharded(entry.value, tuple(values), axes, replicas),
        optimizer_state={
            key: _sharded(entry.value, tuple(p), axes, replicas) for key, p in states.items()
        },
        step=step,
    )


def sharded_master_layout(
    previous: StateLayout, master: ShardedMaster, *, publish: Callable[[], None]
) -> StateLayout:
    """`previous` with every sharded parameter replaced by its flat ranges of this rank's fp32
    master shards and optimizer state; after a load the masters are copied into the model's
    chunks, then `publish` makes them visible (all-gather, refresh gathered units)."""
    if master.files is not None:
        # Offloaded optimizer state is read back before it is described (saved or loaded into);
        # the next optimizer step offloads it again.
        master.files.fetch_all()
    held = _held_pieces(master)

    def refine(entry: ParameterLayout) -> ParameterLayout:
        pieces = held.get(id(entry.param))
        return entry if pieces is None else _refine(entry, pieces, master)

    @torch.no_grad()
    def copy_masters_and_publish() -> None:
        for chunk, fp32 in zip(master.param_chunks, master.masters, strict=True):
            if fp32 is not chunk:
                chunk.copy_(fp32)
        publish()

    return previous.map(refine).then(copy_masters_and_publish)


def frozen_shard_layout(
    previous: StateLayout,
    units: Sequence[Unit],
    axes: tuple[str, ...],
    replica_axes: tuple[str, ...],
) -> StateLayout:
    """`previous` with every parameter of stage 3's frozen units described by its flat ranges
    of this rank's shards (no optimizer state: nothing optimises them). A load writes into the
    shards; the units' publish (`regather_units`) refreshes those that are gathered."""
    held: dict[int, list[tuple[Unit, Piece]]] = {}
    for unit in units:
        if unit.trainable:
            continue
        for slot in unit.segment.slots:
            held.setdefault(id(slot.param), [])
        for piece in unit.segment.pieces():
            held[id(piece.slot.param)].append((unit, piece))

    def refine(entry: ParameterLayout) -> ParameterLayout:
        pieces = held.get(id(entry.param))
        if pieces is None:
            return entry
        if len(entry.value.pieces) != 1 or entry.value.pieces[0].region.flat is not None:
            raise ValueError(
                f"ZeRO-3 shards frozen {entry.name!r} as a flat range of one block, but an "
                f"earlier transform declared it as {len(entry.value.pieces)} piece(s)"
            )
        block = entry.value.pieces[0].region
        values = tuple(
            LocalPiece(
                block.flat_range(piece.param_start, piece.param_start + piece.numel),
                tensor=unit.shard[piece.chunk_start : piece.chunk_start + piece.numel],
            )
            for unit, piece in pieces
        )
        return replace(entry, value=_sharded(entry.value, values, axes, replica_axes))

    return previous.map(refine)


def regather_units(units: Sequence[Unit], comm: Comm) -> None:
    """Stage 3's publish: a unit gathered at load time would keep its stale values, so it is
    all-gathered again (over its segment's group) from the loaded shards; the others gather on
    their next forward."""
    for unit in units:
        if unit.gathered:
            source = unit.shard.to(unit.full.device, unit.full.dtype)
            group = unit.segment.group
            assert group is not None, "ZeRO-3 units are built with their group"
            if group.size == 1:
                unit.full.copy_(source)
            else:
                comm.all_gather(unit.full, source, group=group, purpose="param_gather")
