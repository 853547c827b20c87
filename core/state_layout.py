"""How one rank holds the model's parameters and optimizer state, described in global terms.

Every parameter is named as in the unsharded model (`plait.core.names.normalised_name`, pipeline
chunk prefixes removed) and has a *global* shape. What this rank holds of it is a set of
`LocalPiece`s: each one a `Region` of the global tensor (a rectangular block, or a flat range of a
block's row-major flattening, as ZeRO's flat shards hold) plus the way to reach its storage (a
tensor view, or getter/setter callables). Each optimizer-state tensor that has the parameter's
shape (`exp_avg`, `exp_avg_sq`, `momentum_buffer`, …) is described the same way, and the step
count by a `StepCount`. `sharded_over` and `replicated_over` name the mesh axes along which
ranks hold different parts of the tensor, or identical copies of the same part.

The description is built in the order the transforms were applied: `describe_state` starts from
the module as it stands (every parameter whole, replicated over every mesh axis of size > 1,
optimizer state read from `optimizer.state[param]`) and hands it to each runtime's
`ParallelRuntime.state_layout(previous)`, which refines what the transforms before it declared —
the pipeline restores original names and drops `pp` from the replication axes, tensor
parallelism places its slices in the global tensor, ZeRO replaces whole tensors by flat ranges of
its master shards. Checkpointing, resharding and weight export read the result and never need to
know a strategy's classes; a strategy written outside plait describes its state the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from plait.core.names import normalised_name

if TYPE_CHECKING:
    from torch import nn

    from plait.core.mesh import Mesh
    from plait.core.sharding import ParallelRuntime


@dataclass(frozen=True, slots=True)
class Rectangle:
    """A rectangular block of the global tensor held by a piece: `offsets`/`sizes` in global
    coordinates; `start:stop` the matching elements of the piece's flattened storage."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Region:
    """The part of a global tensor a piece holds.

    A block at `offsets` with `sizes` (a whole tensor, a tensor-parallel slice), or — when
    `flat` is set — only elements `[flat[0], flat[1])` of that block's row-major flattening
    (a ZeRO flat shard of a parameter, or of a tensor-parallel slice of one).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat: tuple[int, int] | None = None

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Region:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        if self.flat is not None:
            return self.flat[1] - self.flat[0]
        return math.prod(self.sizes)

    def narrow(self, dim: int, start: int, length: int) -> Region:
        """Rows `start:start + length` along `dim` of this block (a block region only)."""
        self._require_block("narrow")
        if start < 0 or start + length > self.sizes[dim]:
            raise ValueError(f"rows {start}:{start + length} are outside {self.sizes} on dim {dim}")
        offsets, sizes = list(self.offsets), list(self.sizes)
        offsets[dim] += start
        sizes[dim] = length
        return Region(tuple(offsets), tuple(sizes))

    def flat_range(self, start: int, stop: int) -> Region:
        """Elements `[start, stop)` of this block's row-major flattening (a block region only)."""
        self._require_block("flat_range")
        if not 0 <= start <= stop <= math.prod(self.sizes):
            raise ValueError(f"flat range [{start}, {stop}) is outside a block of {self.sizes}")
        return Region(self.offsets, self.sizes, (start, stop))

    def shifted(self, by: Sequence[int]) -> Region:
        """The same region inside a larger tensor, where this one's origin sits at `by`."""
        offsets = tuple(o + b for o, b in zip(self.offsets, by, strict=True))
        return Region(offsets, self.sizes, self.flat)

    def rectangles(self) -> list[Rectangle]:
        """The region as rectangles of the global tensor (at most 2·ndim − 1 for a flat range)."""
        if self.flat is None:
            return [Rectangle(self.offsets, self.sizes, 0, math.prod(self.sizes))]
        start, stop = self.flat
        if start == stop:
            return []
        if not self.sizes:
            return [Rectangle((), (), 0, 1)]
        return [
            Rectangle(
                tuple(o + b for o, b in zip(offsets, self.offsets, strict=True)),
                sizes,
                a - start,
                b - start,
            )
            for offsets, sizes, a, b in _flat_rectangles(self.sizes, start, stop)
        ]

    def _require_block(self, what: str) -> None:
        if self.flat is not None:
            raise ValueError(f"{what} of a flat range is not a region; describe the block first")


def _flat_rectangles(
    shape: tuple[int, ...], start: int, end: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """(offsets, sizes, flat_start, flat_end) of rectangles covering `[start, end)` of the
    row-major flattening of `shape`: a partial first row, full rows, a partial last row."""
    if len(shape) == 1:
        yield (start,), (end - start,), start, end
        return
    row = math.prod(shape[1:])
    first = start // row
    if start % row or (first == (end - 1) // row and end % row):
        # A partial row: recurse into that row's sub-tensor, then prefix the row index.
        stop = min(end, (first + 1) * row)
        for offsets, sizes, a, b in _flat_rectangles(
            shape[1:], start - first * row, stop - first * row
        ):
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
        for offsets, sizes, a, b in _flat_rectangles(shape[1:], 0, end - start):
            yield (last, *offsets), (1, *sizes), a + start, b + start


@dataclass(frozen=True, slots=True)
class LocalPiece:
    """One piece of a global tensor on this rank, and how to reach its values.

    Either `tensor`, the rank's own storage (a view: shaped like the block, or 1-D for a flat
    range), which a loader writes in place; or `get`/`set` callables for state that is not held
    as one tensor (a loader reads into a copy of `get()` and hands it to `set`).
    """

    region: Region
    tensor: torch.Tensor | None = None
    get: Callable[[], torch.Tensor] | None = None
    set: Callable[[torch.Tensor], None] | None = None

    def __post_init__(self) -> None:
        if (self.tensor is None) == (self.get is None):
            raise ValueError("a LocalPiece has either a tensor or a getter, not both or neither")
        if self.tensor is not None and self.tensor.numel() != self.region.numel:
            raise ValueError(
                f"a piece holding {self.tensor.numel()} elements describes a region of "
                f"{self.region.numel}"
            )

    def read(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        assert self.get is not None
        return self.get()

    @torch.no_grad()
    def write(self, value: torch.Tensor) -> None:
        if self.tensor is not None:
            if value is not self.tensor:
                self.tensor.copy_(value.view_as(self.tensor))
        elif self.set is not None:
            self.set(value)
        else:
            raise ValueError("this piece has a getter but no setter: it cannot be written")


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorLayout:
    """One global tensor (a parameter, or one optimizer-state tensor of one) on this rank."""

    global_shape: torch.Size
    pieces: tuple[LocalPiece, ...] = ()
    # Ranks that differ along these axes hold different parts; along these, identical copies.
    sharded_over: tuple[str, ...] = ()
    replicated_over: tuple[str, ...] = ()

    @classmethod
    def whole(cls, tensor: torch.Tensor, *, replicated_over: Sequence[str] = ()) -> TensorLayout:
        """`tensor` held entirely by this rank (and identically along `replicated_over`)."""
        return cls(
            global_shape=tensor.shape,
            pieces=(LocalPiece(Region.whole(tensor.shape), tensor=tensor),),
            replicated_over=tuple(replicated_over),
        )

    def sharded_along(
        self, axis: str, *, global_shape: Sequence[int], offsets: Sequence[int]
    ) -> TensorLayout:
        """This tensor as the block at `offsets` of a larger one that ranks along `axis` split
        (a tensor-parallel slice): every piece moves by `offsets`."""
        return replace(
            self,
            global_shape=torch.Size(global_shape),
            pieces=tuple(replace(p, region=p.region.shifted(offsets)) for p in self.pieces),
            sharded_over=_with(self.sharded_over, axis),
            replicated_over=_without(self.replicated_over, axis),
        )

    def not_replicated_over(self, axis: str) -> TensorLayout:
        """Ranks along `axis` hold other tensors, not copies of this one (pipeline stages)."""
        return replace(self, replicated_over=_without(self.replicated_over, axis))

    def numel(self) -> int:
        return sum(p.region.numel for p in self.pieces)

    def rebound(self, old: torch.Tensor, new: torch.Tensor) -> TensorLayout:
        """The same layout over `new` instead of `old`, a tensor of the same shape (a parameter's
        fp32 master, or an optimizer-state tensor of that master): every piece that views `old`
        views `new` at the same place."""
        if new.shape != old.shape:
            raise ValueError(f"cannot rebind a {tuple(old.shape)} layout to {tuple(new.shape)}")
        pieces = []
        for piece in self.pieces:
            if piece.tensor is None:
                raise ValueError("a piece read through a getter cannot be rebound to a tensor")
            if piece.tensor.untyped_storage().data_ptr() != old.untyped_storage().data_ptr():
                raise ValueError("a piece of this layout does not view the tensor it replaces")
            offset = piece.tensor.storage_offset() - old.storage_offset()
            view = new.as_strided(
                piece.tensor.shape, piece.tensor.stride(), new.storage_offset() + offset
            )
            pieces.append(replace(piece, tensor=view))
        return replace(self, pieces=tuple(pieces))


def _with(axes: tuple[str, ...], axis: str) -> tuple[str, ...]:
    return axes if axis in axes else (*axes, axis)


def _without(axes: tuple[str, ...], axis: str) -> tuple[str, ...]:
    return tuple(a for a in axes if a != axis)


@dataclass(frozen=True, slots=True)
class StepCount:
    """The optimizer step count of one parameter, read and restored in the optimizer's own
    convention (a Python int for plait's AdamW, a 0-d tensor for torch's optimizers)."""

    get: Callable[[], float | int | torch.Tensor]
    set: Callable[[float | int], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParameterLayout:
    """One parameter of the model: its global name, its values and its optimizer state."""

    name: str
    # The module's parameter object this entry describes: how later runtimes find the entry.
    param: torch.Tensor
    value: TensorLayout
    # Optimizer-state tensors shaped like the parameter, by key (e.g. "exp_avg").
    optimizer_state: Mapping[str, TensorLayout] = field(default_factory=dict)
    step: StepCount | None = None

    def map_tensors(self, transform: Callable[[TensorLayout], TensorLayout]) -> ParameterLayout:
        """The same entry with `transform` applied to its value and every optimizer tensor
        (they share the parameter's layout until a runtime splits them differently)."""
        return replace(
            self,
            value=transform(self.value),
            optimizer_state={k: transform(v) for k, v in self.optimizer_state.items()},
        )


@dataclass(frozen=True, slots=True)
class LoadedFrom:
    """Where a weights-only load read the left-out entries: the source's name, and `read`,
    which reads left-out tensors whole from it (by name, in the dtype asked)."""

    source: str
    read: Callable[[Mapping[str, torch.dtype]], dict[str, torch.Tensor]]


@dataclass(frozen=True, slots=True, kw_only=True)
class StateLayout:
    """Everything this rank holds of the model and its optimizer, by global parameter name.

    `parameters` are what checkpoints write and every load reads. `left_out` are held but left
    out of checkpoints (a LoRA job's frozen base, named as the base's own checkpoint names it):
    later runtimes refine them like the others (`map`), and only a weights-only load
    (`init_from`) fills them.
    """

    parameters: tuple[ParameterLayout, ...] = ()
    left_out: tuple[ParameterLayout, ...] = ()
    # Called in order once new values were written into the pieces (e.g. a checkpoint loaded):
    # to copy master shards into the model, all-gather them, refresh gathered copies.
    after_load: tuple[Callable[[], None], ...] = ()
    # Called after `after_load` once a weights-only load filled `left_out`: to describe what was
    # loaded (the LoRA base's hash).
    after_left_out_load: tuple[Callable[[LoadedFrom], None], ...] = ()

    def by_name(self) -> dict[str, ParameterLayout]:
        """The saved entries (`parameters`) by name."""
        return _by_name(self.parameters)

    def left_out_by_name(self) -> dict[str, ParameterLayout]:
        return _by_name(self.left_out)

    def map(self, refine: Callable[[ParameterLayout], ParameterLayout | None]) -> StateLayout:
        """Refine every entry, saved and left out (`None` drops it)."""
        return replace(
            self,
            parameters=_refined(self.parameters, refine),
            left_out=_refined(self.left_out, refine),
        )

    def leave_out(self, entries: Iterable[ParameterLayout]) -> StateLayout:
        """The same layout with `entries` added to `left_out`."""
        return replace(self, left_out=(*self.left_out, *entries))

    def then_left_out_loaded(self, callback: Callable[[LoadedFrom], None]) -> StateLayout:
        """The same layout with `callback` added to what runs after `left_out` was loaded."""
        return replace(self, after_left_out_load=(*self.after_left_out_load, callback))

    def then(self, callback: Callable[[], None]) -> StateLayout:
        """The same layout with `callback` added to what runs after a load."""
        return replace(self, after_load=(*self.after_load, callback))

    def finish_load(self) -> None:
        for callback in self.after_load:
            callback()

    def finish_left_out_load(self, loaded: LoadedFrom) -> None:
        for callback in self.after_left_out_load:
            callback(loaded)


def _by_name(entries: Iterable[ParameterLayout]) -> dict[str, ParameterLayout]:
    named: dict[str, ParameterLayout] = {}
    for entry in entries:
        if entry.name in named:
            raise ValueError(f"two parameters of this rank are described as {entry.name!r}")
        named[entry.name] = entry
    return named


def _refined(
    entries: Iterable[ParameterLayout], refine: Callable[[ParameterLayout], ParameterLayout | None]
) -> tuple[ParameterLayout, ...]:
    return tuple(e for e in (refine(entry) for entry in entries) if e is not None)


# -- the starting point ---------------------------------------------------------------------------


def set_step_count(state: dict[str, Any], step: float | int) -> None:
    """Store `step` in `state` the way the optimizer keeps it (Python int or 0-d tensor)."""
    current = state.get("step")
    if isinstance(current, torch.Tensor):
        state["step"] = torch.tensor(float(step), dtype=current.dtype, device=current.device)
    else:
        state["step"] = int(step)


def optimizer_state_layout(
    state: dict[str, Any], like: torch.Tensor, *, replicated_over: Sequence[str] = ()
) -> tuple[dict[str, TensorLayout], StepCount | None]:
    """The tensors of one optimizer parameter's `state` that have `like`'s shape, held whole,
    and its step count."""
    tensors = {
        key: TensorLayout.whole(value, replicated_over=replicated_over)
        for key, value in state.items()
        if key != "step" and isinstance(value, torch.Tensor) and value.shape == like.shape
    }
    step = (
        StepCount(get=lambda: state["step"], set=lambda value: set_step_count(state, value))
        if "step" in state
        else None
    )
    return tensors, step


def module_state_layout(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    replicated_over: Sequence[str] = (),
) -> StateLayout:
    """The module as it stands: every parameter whole under its normalised name, identical on
    every rank along `replicated_over`, its optimizer state from `optimizer.state[param]`."""
    entries: list[ParameterLayout] = []
    seen: set[int] = set()
    for local_name, param in module.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        state = optimizer.state.get(param) if optimizer is not None else None
        tensors, step = (
            optimizer_state_layout(state, param, replicated_over=replicated_over)
            if state
            else ({}, None)
        )
        entries.append(
            ParameterLayout(
                name=normalised_name(local_name),
                param=param,
                value=TensorLayout.whole(param.detach(), replicated_over=replicated_over),
                optimizer_state=tensors,
                step=step,
            )
        )
    return StateLayout(parameters=tuple(entries))


def describe_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    runtimes: Iterable[ParallelRuntime],
    mesh: Mesh,
) -> StateLayout:
    """This rank's state as the applied strategies declare it: the module's own layout refined
    by each runtime's `state_layout`, in the order the transforms were applied."""
    axes = tuple(axis for axis, size in mesh.degrees.items() if size > 1)
    layout = module_state_layout(module, optimizer, replicated_over=axes)
    for runtime in runtimes:
        layout = runtime.state_layout(layout)
    return layout
