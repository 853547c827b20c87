"""This rank's fp32 master shards, their gradients, and the user's optimizer built over them.

Every ZeRO stage ends a backward pass with, per segment, this rank's reduced gradient chunk and
its parameter chunk. `ShardedMaster` turns the chunks' runs into optimizer parameters (views, so
an fp32 model on the master device is updated in place with no extra copy), computes the global
gradient norm from the shards, moves gradients and updates between devices when the optimizer
is offloaded, and gathers the optimizer state into a full, unsharded state dict keyed by
parameter name (and scatters one back).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from plait.core.comm import Comm, Group, world_group
from plait.core.comm_algorithms import GRAD_NORM, OPTIMIZER_STATE
from plait.core.grad_norm import sharded_axes
from plait.core.memory import optimizer_state_tensors, storage_bytes
from plait.core.mesh import Mesh
from plait.core.sharding import OptimizerFactory
from plait.plugins.zero.config import OffloadConfig
from plait.plugins.zero.flat_buffer import Run, Segment
from plait.plugins.zero.offload import FileOffload, empty_on, master_device
from plait.plugins.zero.reduction import ensure_allocated, release


def _run_view(chunk: torch.Tensor, run: Run) -> torch.Tensor:
    view = chunk[run.start : run.start + run.numel]
    return view.view(1, -1) if run.is_matrix else view


class ShardedMaster:
    """Master shards of all segments on this rank and the optimizer that updates them."""

    def __init__(
        self,
        segments: Sequence[Segment],
        param_chunks: Sequence[torch.Tensor],
        grad_chunks: Sequence[torch.Tensor],
        *,
        comm: Comm,
        group: Group,
        mesh: Mesh,
        offload: OffloadConfig,
        gather_state: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
        across_replicas: bool = False,
    ) -> None:
        self.segments = list(segments)
        self.across_replicas = across_replicas
        self._gather_state = gather_state
        self.param_chunks = list(param_chunks)
        self.grad_chunks = list(grad_chunks)
        self.comm, self.group, self.mesh = comm, group, mesh
        self.device = master_device(offload.device, segments[0].device)
        self.masters: list[torch.Tensor] = []
        self.master_grads: list[torch.Tensor] = []
        for pc, gc in zip(param_chunks, grad_chunks, strict=True):
            aliased = pc.device == self.device and pc.dtype == torch.float32
            self.masters.append(pc if aliased else empty_on(self.device, pc.numel(), torch.float32))
            if not aliased:
                self.masters[-1].copy_(pc)
            grads_aliased = gc.device == self.device and gc.dtype == torch.float32
            self.master_grads.append(
                gc if grads_aliased else empty_on(self.device, gc.numel(), torch.float32)
            )
        # (segment index, run, optimizer parameter)
        self.runs: list[tuple[int, Run, nn.Parameter]] = []
        for k, seg in enumerate(self.segments):
            for run in seg.runs():
                param = nn.Parameter(_run_view(self.masters[k], run))
                param.grad = _run_view(self.master_grads[k], run)
                self.runs.append((k, run, param))
        self._norm_pieces = self._weighted_grad_pieces()
        self.optimizer: torch.optim.Optimizer | None = None
        self.files = (
            FileOffload(offload.path, rank=mesh.rank, io_workers=offload.io_workers)
            if offload.device == "nvme"
            else None
        )

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The axes the chunks split over: under HSDP dp_shard (× cp), unless the chunks are
        shards over every dp rank although dp is split (`replica_shards`)."""
        return self.mesh.gradient_axes() if self.across_replicas else self.mesh.shard_axes()

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The axes holding identical copies of the chunks (dp_replicate under HSDP)."""
        return () if self.across_replicas else self.mesh.replica_axes()

    # -- optimizer -------------------------------------------------------------------------------

    def build_optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        optimizer = factory(p for _, _, p in self.runs)
        optimizer.register_step_pre_hook(lambda *_: self._before_step())
        optimizer.register_step_post_hook(lambda *_: self._after_step())
        self.optimizer = optimizer
        return optimizer

    def prefetch_state(self) -> None:
        """Start reading offloaded optimizer state back (called while backward still runs)."""
        if self.files is not None:
            self.files.prefetch()

    def _ensure_gradients(self) -> None:
        for gc in self.grad_chunks:
            if ensure_allocated(gc):  # released, and no backward reduced into it since
                gc.zero_()

    def _before_step(self) -> None:
        self._ensure_gradients()
        for k, run, param in self.runs:
            if param.grad is None:  # a user's optimizer.zero_grad(set_to_none=True)
                param.grad = _run_view(self.master_grads[k], run)
        for gc, mg in zip(self.grad_chunks, self.master_grads, strict=True):
            if mg is not gc:
                mg.copy_(gc, non_blocking=True)
        if self.files is not None:
            self.files.prefetch()
            self.files.wait()
        if self.device.type == "cpu" and self.segments[0].device.type == "cuda":
            torch.cuda.current_stream(self.segments[0].device).synchronize()

    def _after_step(self) -> None:
        for pc, master in zip(self.param_chunks, self.masters, strict=True):
            if master is not pc:
                pc.copy_(master, non_blocking=True)
        if self.files is not None:
            self.files.offload(self._state_items())

    def _state_items(self) -> list[tuple[str, torch.Tensor]]:
        assert self.optimizer is not None
        items = []
        for i, (_, _, param) in enumerate(self.runs):
            for key, value in self.optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    items.append((f"run{i}.{key}", value))
        return items

    # -- gradients -------------------------------------------------------------------------------

    def _weighted_grad_pieces(self) -> list[tuple[torch.Tensor, float]]:
        """Each parameter piece's gradient view with the weight that makes one all-reduce over
        the world count every distinct element once (see `plait.core.grad_norm`)."""
        pieces = []
        for seg, gc in zip(self.segments, self.grad_chunks, strict=True):
            for piece in seg.pieces():
                shards = 1
                # dp (× cp) share it, or under HSDP dp_shard (× cp): each replica holds a copy.
                for axis in dict.fromkeys((*sharded_axes(piece.slot.param), *self.shard_axes)):
                    shards *= self.mesh.size(axis)
                view = gc[piece.chunk_start : piece.chunk_start + piece.numel]
                pieces.append((view, shards / self.mesh.world_size))
        return pieces

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the full gradient from the shards; scale them to `max_norm`."""
        self._ensure_gradients()
        device = self.grad_chunks[0].device
        total = torch.zeros((), dtype=torch.float32, device=device)
        by_weight: dict[float, list[torch.Tensor]] = {}
        for view, weight in self._norm_pieces:
            by_weight.setdefault(weight, []).append(view)
        for weight, views in by_weight.items():
            norms = torch._foreach_norm([v.float() for v in views])
            total += torch.stack(norms).pow(2).sum() * weight
        if self.mesh.world_size > 1:
            self.comm.all_reduce(total, group=world_group(), op="sum", purpose=GRAD_NORM)
        norm = total.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(self.grad_chunks, coef)
        return norm

    def release_gradients(self) -> None:
        """Free the gradient chunks until the next backward reduces into them: like FSDP2,
        sharded gradients exist only from backward to the optimizer step."""
        for gc in self.grad_chunks:
            release(gc)

    def gradient_bytes(self) -> int:
        return storage_bytes(self.grad_chunks)

    # -- accounting and state --------------------------------------------------------------------

    def optimizer_state_bytes(self) -> int:
        if self.optimizer is None:
            return 0
        return storage_bytes(optimizer_state_tensors(self.optimizer))

    def master_bytes(self) -> int:
        """Bytes of master shards that are separate copies (not views of the model's chunks)."""
        return storage_bytes(
            m for m, pc in zip(self.masters, self.param_chunks, strict=True) if m is not pc
        ) + storage_bytes(
            g for g, gc in zip(self.master_grads, self.grad_chunks, strict=True) if g is not gc
        )

    def _ensure_resident(self) -> None:
        if self.files is not None:
            self.files.fetch_all()

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state: `{"state": {param name: {key: tensor}}, "param_groups"}`."""
        assert self.optimizer is not None
        self._ensure_resident()
        opt_state = self.optimizer.state
        template = next((opt_state[p] for _, _, p in self.runs if opt_state.get(p)), {})
        tensor_keys = sorted(
            k for k, v in template.items() if isinstance(v, torch.Tensor) and v.ndim > 0
        )
        scalars = {k: v for k, v in template.items() if k not in tensor_keys}
        full: dict[str, dict[str, Any]] = {}
        comm_device = self.segments[0].device
        for k, seg in enumerate(self.segments):
            per_key = {}
            for key in tensor_keys:
                chunk = torch.zeros(seg.chunk_numel, dtype=torch.float32, device=comm_device)
                for seg_index, run, param in self.runs:
                    if seg_index == k and key in opt_state.get(param, {}):
                        value = opt_state[param][key].reshape(-1)
                        chunk[run.start : run.start + run.numel].copy_(value)
                group = seg.group if seg.group is not None else self.group
                if self._gather_state is not None:
                    whole = torch.empty(seg.padded_numel, dtype=torch.float32, device=comm_device)
                    self._gather_state(k, whole, chunk)
                elif group.size == 1:  # a one-rank expert-dp group: the chunk is the segment
                    whole = chunk
                else:
                    whole = torch.empty(seg.padded_numel, dtype=torch.float32, device=comm_device)
                    self.comm.all_gather(whole, chunk, group=group, purpose=OPTIMIZER_STATE)
                per_key[key] = whole
            for slot in seg.slots:
                entry = {key: _clone(v) for key, v in scalars.items()}
                for key, whole in per_key.items():
                    values = whole[slot.offset : slot.offset + slot.numel]
                    entry[key] = values.view(slot.shape).cpu()
                full[slot.name] = entry
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        if self.files is not None:
            self.files.offload(self._state_items())
        return {"state": full if tensor_keys or scalars else {}, "param_groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's chunks of a full state dict as returned by `state_dict`."""
        assert self.optimizer is not None
        full = state["state"]
        missing = sorted({s.name for seg in self.segments for s in seg.slots} - set(full))
        if full and missing:
            raise KeyError(f"optimizer state has no entry for parameter(s) {missing[:5]}")
        if self.files is not None:
            self.files.forget()
        for k, seg in enumerate(self.segments):
            if not full:
                break
            first = full[seg.slots[0].name]
            tensor_keys = [key for key, v in first.items() if isinstance(v, torch.Tensor)]
            tensor_keys = [key for key in tensor_keys if first[key].ndim > 0]
            chunks = {}
            for key in tensor_keys:
                whole = torch.zeros(seg.padded_numel, dtype=torch.float32)
                seg.flatten([full[s.name][key] for s in seg.slots], whole)
                chunks[key] = seg.chunk_of(whole)
            for seg_index, run, param in self.runs:
                if seg_index != k:
                    continue
                entry = {key: _clone(v) for key, v in first.items() if key not in tensor_keys}
                for key, chunk in chunks.items():
                    values = chunk[run.start : run.start + run.numel].to(self.device)
                    entry[key] = values.view_as(param).clone()
                self.optimizer.state[param] = entry
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=False):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def close(self) -> None:
        if self.files is not None:
            self.files.close()


def model_state_report(
    *, parameters: int, gradients_at_step: int, resident_gradients: int, optimizer_state: int
) -> dict[str, int]:
    """A ZeRO runtime's `memory_report()`: bytes of parameters, gradients and optimizer state.

    `gradients` and `total` describe the optimizer step, when all three exist: the ZeRO paper's
    per-rank model state. Stages 2 and 3 release the gradient chunks after the step (until the
    next backward reduces into them), so between steps only `resident_gradients` and
    `resident_total` are held.
    """
    report = {
        "parameters": parameters,
        "gradients": gradients_at_step,
        "optimizer_state": optimizer_state,
    }
    report["total"] = sum(report.values())
    report["resident_gradients"] = resident_gradients
    report["resident_total"] = parameters + resident_gradients + optimizer_state
    return report


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
