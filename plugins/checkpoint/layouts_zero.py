"""The checkpoint layout of the ZeRO runtimes: flat fp32 master shards and their optimizer state.

Every ZeRO stage keeps, per segment (`plait.plugins.zero.flat_buffer.Segment`), this rank's
contiguous chunk of the parameters laid end to end; `ShardedMaster` holds that chunk's fp32
master copy and hands the optimizer one parameter per *run* of the chunk (matrices, then
vectors). A `Piece` of the chunk is a flat range of one parameter, which `flat_range_chunks`
turns into at most 2·ndim − 1 rectangles of the parameter (shifted into the global tensor when
the parameter is itself a tensor-parallel slice). The same ranges of the run's `exp_avg` /
`exp_avg_sq` are the optimizer state's pieces, so weights and state reshard to any layout.

Weights are saved from, and loaded into, the fp32 masters: the truth when the model runs in
lower precision. After a load the masters are copied into the model's chunks and, for stages 1
and 2, the chunks are all-gathered into every rank's full flat buffers (the same all-gather
that follows an optimizer step); stage 3 gathers a unit from its shard on the next forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait.plugins.checkpoint.layout import (
    TENSOR_STATE_KEYS,
    Placement,
    TensorPieces,
    empty_adam_state,
    set_step_count,
)


def zero_layout(
    runtime: Any,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    placement: Placement,
) -> ZeroLayout | None:
    """The layout of `runtime` if it is a ZeRO runtime (else None)."""
    try:
        from plait.plugins.zero.stage3 import FullyShardedRuntime
        from plait.plugins.zero.stage12 import ShardedOptimizerRuntime
    except ImportError:  # the plugin is not installed: no runtime of this job is ZeRO
        return None
    if not isinstance(runtime, ShardedOptimizerRuntime | FullyShardedRuntime):
        return None
    return ZeroLayout(runtime, module, optimizer, placement)


class ZeroLayout:
    """What this rank holds under `zero1`, `zero2` or `zero3`, by original FQN."""

    def __init__(
        self,
        runtime: Any,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        placement: Placement,
    ) -> None:
        self.runtime = runtime
        self.master = runtime.master
        self.optimizer = optimizer if optimizer is not None else self.master.optimizer
        self.placement = placement
        self._run_params_of: dict[str, list[nn.Parameter]] | None = None
        sharded = {id(s.param) for seg in self.master.segments for s in seg.slots}
        # Frozen parameters are not in any segment: every rank holds them whole.
        self.frozen: dict[str, nn.Parameter] = {}
        for name, param in module.named_parameters():
            if id(param) not in sharded:
                self.frozen.setdefault(placement.name(param, name), param)

    def _runs_by_segment(self) -> dict[int, list[tuple[Any, nn.Parameter]]]:
        runs: dict[int, list[tuple[Any, nn.Parameter]]] = {}
        for segment_index, run, param in self.master.runs:
            runs.setdefault(segment_index, []).append((run, param))
        return runs

    def _pieces(self) -> Iterator[tuple[str, int, Any, nn.Parameter | None]]:
        """(original FQN, segment index, piece, the optimizer parameter of its run) for every
        piece of a parameter in this rank's chunks."""
        runs = self._runs_by_segment()
        for k, segment in enumerate(self.master.segments):
            for piece in segment.pieces():
                run_param = next(
                    (
                        p
                        for run, p in runs.get(k, [])
                        if run.start <= piece.chunk_start < run.start + run.numel
                    ),
                    None,
                )
                name = self.placement.name(piece.slot.param, piece.slot.name)
                yield name, k, piece, run_param

    def _all_names(self) -> dict[str, Any]:
        """Every sharded parameter's FQN -> its slot (a rank may hold no piece of some)."""
        return {
            self.placement.name(slot.param, slot.name): slot
            for segment in self.master.segments
            for slot in segment.slots
        }

    def _empty(self, slot: Any) -> TensorPieces:
        global_shape, _ = self.placement.block(slot.param, slot.shape)
        return TensorPieces(global_shape)

    def _ranges(self, piece: Any, flat: torch.Tensor) -> list[Any]:
        slot = piece.slot
        return self.placement.flat_range(slot.param, flat, piece.param_start, slot.shape)

    def _ensure_resident(self) -> None:
        # Optimizer state offloaded to files is read back before it is saved or loaded into;
        # the next optimizer step offloads it again.
        if self.master.files is not None:
            self.master.files.fetch_all()

    # -- StateLayout ------------------------------------------------------------------------------

    def model_pieces(self) -> dict[str, TensorPieces]:
        pieces = {name: self._empty(slot) for name, slot in self._all_names().items()}
        for name, k, piece, _ in self._pieces():
            master = self.master.masters[k]
            flat = master[piece.chunk_start : piece.chunk_start + piece.numel]
            pieces[name].chunks.extend(self._ranges(piece, flat))
        for name, param in self.frozen.items():
            pieces[name] = self.placement.whole(param, param.detach())
        return pieces

    def optimizer_pieces(self, create: bool = False) -> dict[str, dict[str, Any]]:
        optimizer = self.optimizer
        if optimizer is None:
            return {}
        self._ensure_resident()
        entries: dict[str, dict[str, Any]] = {}
        runs = self._runs_by_segment()
        for name, k, piece, run_param in self._pieces():
            if run_param is None:
                continue
            state = optimizer.state.get(run_param)
            if not state:
                if not create:
                    continue
                state = optimizer.state[run_param] = empty_adam_state(optimizer, run_param)
            run = next(r for r, p in runs[k] if p is run_param)
            start = piece.chunk_start - run.start
            entry = entries.setdefault(name, {})
            for key, value in state.items():
                if key == "step":
                    entry["step"] = value
                elif key in TENSOR_STATE_KEYS and isinstance(value, torch.Tensor):
                    flat = value.view(-1)[start : start + piece.numel]
                    pieces = entry.setdefault(key, self._empty(piece.slot))
                    pieces.chunks.extend(self._ranges(piece, flat))
        return entries

    def set_step(self, name: str, step: float | int) -> None:
        if self.optimizer is None:
            return
        if self._run_params_of is None:
            self._run_params_of = {}
            for piece_name, _, _, run_param in self._pieces():
                if run_param is not None:
                    self._run_params_of.setdefault(piece_name, []).append(run_param)
        for run_param in self._run_params_of.get(name, []):
            if run_param in self.optimizer.state:
                set_step_count(self.optimizer.state[run_param], step)

    def after_load(self) -> None:
        master = self.master
        with torch.no_grad():
            for chunk, fp32 in zip(master.param_chunks, master.masters, strict=True):
                if fp32 is not chunk:
                    chunk.copy_(fp32)
        units = getattr(self.runtime, "units", None)
        if units is None:
            # Stages 1 and 2: every rank's full flat buffers get every rank's loaded chunk.
            self.runtime.after_optimizer_step()
            return
        for unit in units:
            if unit.gathered:  # a gathered stage-3 unit would keep its stale values
                source = unit.shard.to(unit.full.device, unit.full.dtype)
                self.runtime.comm.all_gather(
                    unit.full, source, group=self.runtime.group, purpose="param_gather"
                )
