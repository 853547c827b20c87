"""ZeRO stages 1 and 2: replicated parameters, sharded optimizer state (and, in stage 2, gradients).

Parameters are packed into segments, one per gradient bucket (bucketed like DDP, by
`plait.core.buckets.assign_buckets`, in reverse registration order so buckets complete
roughly in order during backward); every `param.data` becomes a view of its segment's flat buffer.
Buckets are reduced asynchronously from post-accumulate-grad hooks while backward runs, launched
strictly in bucket order so every rank issues the same collective sequence.

- Stage 1 keeps full gradient buffers (`param.grad` are views, as in DDP) and all-reduces each
  bucket on the last micro-batch only; the optimizer reads this rank's chunk of each.
- Stage 2 keeps only this rank's gradient chunks. A bucket's full buffer exists just while the
  bucket is being filled and reduce-scattered (at most `MAX_IN_FLIGHT` buckets at once); each
  micro-batch's gradients are reduce-scattered and summed into the chunks (sharded accumulation;
  on Gloo an all-reduce stands in for the reduce-scatter, see `plait.plugins.zero.reduction`).
  The chunks are released after the optimizer step, until the next backward.

After the optimizer step each segment's updated chunks are all-gathered into the flat buffers.

Under HSDP (`parallel.dp_shard`) buckets are reduced, and the optimizer state sharded, over the
shard group; the reduced chunks are averaged across the replica group once per step, or with
`[zero] shard_optimizer_across_replicas` reduce-scattered across it, so that the optimizer
state is sharded over every dp rank (`plait.plugins.zero.replica_shards`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.core.buckets import assign_buckets
from plait.core.comm import Comm, Group, Work
from plait.core.comm_algorithms import GRAD_BUCKET, PARAM_GATHER
from plait.core.memory import storage_bytes
from plait.core.mesh import Mesh
from plait.core.schedule import MicrobatchPosition
from plait.core.sharding import OptimizerFactory, ParallelRuntime
from plait.core.state_layout import StateLayout
from plait.core.transforms import ExpertParallelism
from plait.plugins.zero.config import ZeroConfig
from plait.plugins.zero.flat_buffer import Segment
from plait.plugins.zero.groups import broadcast_module, runs_by_group
from plait.plugins.zero.layout import sharded_master_layout
from plait.plugins.zero.optimizer import ShardedMaster, model_state_report
from plait.plugins.zero.reduction import (
    PendingReduction,
    average_across_replicas,
    codec_attributes,
    ensure_allocated,
    launch_reduction,
    release,
)
from plait.plugins.zero.replica_shards import ReplicaShards

# Stage 2: buckets whose full gradient buffer may be alive at once (being reduce-scattered).
MAX_IN_FLIGHT = 2


@dataclass(eq=False)
class BucketState:
    segment: Segment
    ready: int = 0
    buffer: torch.Tensor | None = None  # stage 2: the full gradient bucket while it is filled
    has_grad: list[bool] = field(default_factory=list)  # stage 2: per slot, this backward
    work: Work | None = None  # stage 1: the all-reduce in flight
    pending: PendingReduction | None = None  # stage 2: the reduction in flight
    launched: bool = False

    def __post_init__(self) -> None:
        self.slot_index = {id(s.param): i for i, s in enumerate(self.segment.slots)}
        self.has_grad = [False] * len(self.segment.slots)


__all__ = ["MAX_IN_FLIGHT", "ShardedOptimizerRuntime", "broadcast_module"]


class ShardedOptimizerRuntime(ParallelRuntime):
    """The runtime of `zero1` and `zero2`."""

    def __init__(
        self,
        module: nn.Module,
        *,
        stage: int,
        comm: Comm,
        group: Group,
        mesh: Mesh,
        config: ZeroConfig,
        experts: ExpertParallelism | None = None,
        replicas: Group | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizerRuntime implements stages 1 and 2, not {stage}")
        self.name = f"zero{stage}"
        self.gradients_consumed_each_microbatch = stage == 2
        self.stage, self.comm, self.group = stage, comm, group
        self.replicas = replicas
        self.gradient_reduction = config.gradient_reduction
        self.gradient_codec = codec_attributes(config.gradient_codec, config.quantize_block)
        # Frozen parameters (a LoRA base) stay as they are, replicated: no segment, no bucket,
        # no reduction, no optimizer state.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad][::-1]
        self.frozen = [p for p in module.parameters() if not p.requires_grad]
        if not named:
            raise ValueError(f"{self.name}: the module has no trainable parameters")
        if config.broadcast_parameters:
            # Every replica starts from the same values: copy over all of dp (× cp).
            everyone = mesh.gradient_group()
            if everyone.size > 1:
                broadcast_module(module, comm, everyone, experts)
        name_of = {id(p): n for n, p in named}
        across = config.shard_optimizer_across_replicas and replicas is not None
        replica_count = replicas.size if across and replicas is not None else 1
        # Expert parameters (ep > 1) are bucketed apart: their segments use the expert-dp group.
        buckets = [
            (run_group, bucket)
            for run_group, run in runs_by_group(named, group, experts)
            for bucket in assign_buckets([p for _, p in run], int(config.bucket_mb * 2**20))
        ]
        self.buckets = [
            BucketState(
                Segment(
                    i,
                    [(name_of[id(p)], p) for p in b],
                    world_size=g.size,
                    rank=g.rank_of(mesh.rank),
                    group=g,
                    padding_multiple=g.size * replica_count,
                )
            )
            for i, (g, b) in enumerate(buckets)
        ]
        self._bucket_of = {id(s.param): b for b in self.buckets for s in b.segment.slots}
        self.flat_params = [self._pack_parameters(b.segment) for b in self.buckets]
        if stage == 1:
            self.flat_grads = [self._attach_gradients(b.segment) for b in self.buckets]
            grad_chunks = [
                b.segment.chunk_of(g) for b, g in zip(self.buckets, self.flat_grads, strict=True)
            ]
        else:
            self.flat_grads = []
            grad_chunks = [
                torch.zeros(b.segment.chunk_numel, dtype=b.segment.dtype, device=b.segment.device)
                for b in self.buckets
            ]
        self.grad_chunks = grad_chunks
        segments = [b.segment for b in self.buckets]
        self.replica_shards = (
            ReplicaShards(segments, comm=comm, replicas=replicas, rank=mesh.rank)
            if across and replicas is not None
            else None
        )
        if self.replica_shards is None:
            self.master = ShardedMaster(
                segments,
                [s.chunk_of(f) for s, f in zip(segments, self.flat_params, strict=True)],
                grad_chunks,
                comm=comm,
                group=group,
                mesh=mesh,
                offload=config.offload,
            )
        else:
            self.master = ShardedMaster(
                self.replica_shards.segments,
                self.replica_shards.param_chunks(self.flat_params),
                self.replica_shards.grad_chunks,
                comm=comm,
                group=group,
                mesh=mesh,
                offload=config.offload,
                gather_state=self.replica_shards.gather_state,
                across_replicas=True,
            )
        self._reduce_this_backward = True
        self._first_microbatch = True
        self._next_to_launch = 0
        self._in_flight: list[BucketState] = []
        self._gradient_bytes_at_step = self._gradient_bytes()
        for _, p in named:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _pack_parameters(self, segment: Segment) -> torch.Tensor:
        flat = torch.zeros(segment.padded_numel, dtype=segment.dtype, device=segment.device)
        with torch.no_grad():
            segment.flatten([s.param.detach() for s in segment.slots], flat)
        for slot, view in zip(segment.slots, segment.views(flat), strict=True):
            slot.param.data = view
        return flat

    def _attach_gradients(self, segment: Segment) -> torch.Tensor:
        flat = torch.zeros(segment.padded_numel, dtype=segment.dtype, device=segment.device)
        for slot, view in zip(segment.slots, segment.views(flat), strict=True):
            slot.param.grad = view
        return flat

    # -- backward hooks and launches -----------------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._reduce_this_backward:
            return
        bucket = self._bucket_of[id(param)]
        if self.stage == 1 or self._move_into_bucket(bucket, param):
            bucket.ready += 1
        if bucket.ready == len(bucket.segment.slots):
            while self._next_to_launch < len(self.buckets):
                candidate = self.buckets[self._next_to_launch]
                if candidate.ready < len(candidate.segment.slots):
                    break
                self._launch(candidate)

    def _move_into_bucket(self, bucket: BucketState, param: nn.Parameter) -> bool:
        """Copy `param.grad` into the bucket and drop it; True if it is the parameter's first
        gradient this backward (a second one, e.g. from a reentrant recompute, is added)."""
        segment = bucket.segment
        if bucket.buffer is None:
            # Not zero-filled: each slot is overwritten by its gradient; `_launch` zeroes the
            # padding and the slots of parameters that got none.
            bucket.buffer = torch.empty(
                segment.padded_numel, dtype=segment.dtype, device=segment.device
            )
        index = bucket.slot_index[id(param)]
        slot = segment.slots[index]
        assert param.grad is not None
        target = bucket.buffer[slot.offset : slot.offset + slot.numel]
        first = not bucket.has_grad[index]
        if first:
            target.copy_(param.grad.reshape(-1))
            bucket.has_grad[index] = True
        else:
            target.add_(param.grad.reshape(-1))
        param.grad = None  # the only full-size copy is the bucket's, freed after reduction
        return first

    def _launch(self, bucket: BucketState) -> None:
        index = bucket.segment.index
        group = _group(bucket.segment)
        if self.stage == 1:
            self._restore_grad_views(bucket)
            if group.size > 1:  # a one-rank group (expert-dp at ep = dp) has nothing to do
                bucket.work = self.comm.all_reduce(
                    self.flat_grads[index],
                    group=group,
                    op="avg",
                    async_op=True,
                    purpose=GRAD_BUCKET,
                    attributes={"bucket_index": index},
                )
        else:
            segment = bucket.segment
            if bucket.buffer is None:  # no parameter of the bucket got a gradient
                bucket.buffer = torch.zeros(
                    segment.padded_numel, dtype=segment.dtype, device=segment.device
                )
            else:
                bucket.buffer[segment.numel :].zero_()
                for slot, filled in zip(segment.slots, bucket.has_grad, strict=True):
                    if not filled:
                        bucket.buffer[slot.offset : slot.offset + slot.numel].zero_()
            ensure_allocated(self.grad_chunks[index])
            bucket.pending = launch_reduction(
                self.comm,
                group,
                segment,
                bucket.buffer,
                self.grad_chunks[index],
                accumulate=not self._first_microbatch,
                method=self.gradient_reduction,
                codec=self.gradient_codec,
            )
            bucket.buffer = None  # the pending reduction holds it until it completes
            self._in_flight.append(bucket)
            if len(self._in_flight) > MAX_IN_FLIGHT:
                self._complete(self._in_flight.pop(0))
        bucket.launched = True
        self._next_to_launch = index + 1

    def _restore_grad_views(self, bucket: BucketState) -> None:
        """If user code replaced a `.grad`, copy it back into the flat buffer before reducing."""
        segment = bucket.segment
        views = segment.views(self.flat_grads[segment.index])
        for slot, view in zip(segment.slots, views, strict=True):
            grad = slot.param.grad
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            slot.param.grad = view

    def _complete(self, bucket: BucketState) -> None:
        if bucket.work is not None:
            bucket.work.wait()
        if bucket.pending is not None:
            bucket.pending.complete()
        bucket.work, bucket.buffer, bucket.pending = None, None, None
        bucket.launched, bucket.ready = False, 0
        bucket.has_grad = [False] * len(bucket.segment.slots)

    def _finish_backward(self) -> None:
        """Reduce buckets left incomplete (parameters without gradients count as zero), wait for
        every reduction, and release the stage 2 bucket buffers."""
        if self.group.size == 1 and self.stage == 1:
            return
        while self._next_to_launch < len(self.buckets):
            self._launch(self.buckets[self._next_to_launch])
        for bucket in self.buckets:
            self._complete(bucket)
        self._in_flight.clear()
        self._next_to_launch = 0

    # -- ParallelRuntime -------------------------------------------------------------------------

    def before_backward(self, position: MicrobatchPosition) -> None:
        if self.stage == 2 and not position.first:
            self._finish_backward()
        self._first_microbatch = position.first
        self._reduce_this_backward = self.stage == 2 or position.last
        for bucket in self.buckets:
            bucket.ready = 0
        if position.last:
            self.master.prefetch_state()

    def sync_gradients(self) -> None:
        self._finish_backward()
        if self.replica_shards is not None:
            self.replica_shards.reduce_scatter_gradients(self.grad_chunks)
        else:
            average_across_replicas(self.comm, self.replicas, self.grad_chunks)
        self._reduce_this_backward = True
        self._gradient_bytes_at_step = self._gradient_bytes()

    def _gradient_bytes(self) -> int:
        buffers = [b.buffer for b in self.buckets if b.buffer is not None]
        subs = self.replica_shards.grad_chunks if self.replica_shards is not None else []
        return storage_bytes([*self.flat_grads, *self.grad_chunks, *subs, *buffers])

    def build_optimizer(
        self, module: nn.Module, factory: OptimizerFactory
    ) -> torch.optim.Optimizer | None:
        del module
        return self.master.build_optimizer(factory)

    def clip_gradients(self, max_norm: float) -> torch.Tensor | None:
        return self.master.clip_gradients(max_norm)

    def after_optimizer_step(self) -> None:
        if self.replica_shards is not None:
            self.replica_shards.gather_parameters(self.flat_params)
            return
        if self.group.size == 1:
            return
        pending = []
        for bucket, flat, updated in zip(
            self.buckets, self.flat_params, self.master.param_chunks, strict=True
        ):
            group = _group(bucket.segment)
            if group.size == 1:  # the chunk is the whole segment, already updated in place
                continue
            chunk = updated.clone()  # the input of an all-gather must not alias its output
            work = self.comm.all_gather(
                flat, chunk, group=group, async_op=True, purpose=PARAM_GATHER
            )
            pending.append((chunk, work))
        for _, work in pending:
            work.wait()

    def zero_grad(self) -> bool:
        if self.stage == 1:
            for bucket, flat in zip(self.buckets, self.flat_grads, strict=True):
                flat.zero_()
                self._restore_grad_views(bucket)
        else:
            self.master.release_gradients()
            if self.replica_shards is not None:  # the shard-group chunks, reduced into them
                for chunk in self.grad_chunks:
                    release(chunk)
        return True

    def memory_report(self) -> dict[str, int] | None:
        if self.master.files is not None:
            self.master.files.wait()  # count what is really resident, not what is in flight
        report = model_state_report(
            parameters=storage_bytes([*self.flat_params, *self.frozen])
            + self.master.master_bytes(),
            gradients_at_step=self._gradient_bytes_at_step,
            resident_gradients=self._gradient_bytes(),
            optimizer_state=self.master.optimizer_state_bytes(),
        )
        report["frozen_parameters"] = storage_bytes(self.frozen)
        if self.master.files is not None:
            report["offloaded_optimizer_state"] = self.master.files.offloaded_bytes
        return report

    def state_layout(self, previous: StateLayout) -> StateLayout:
        # After a load, every rank's flat buffers get every rank's loaded chunk.
        return sharded_master_layout(previous, self.master, publish=self.after_optimizer_step)

    def state_dict(self) -> dict[str, Any]:
        return self.master.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.master.load_state_dict(state)


def _group(segment: Segment) -> Group:
    assert segment.group is not None, "ZeRO stage 1/2 segments are built with their group"
    return segment.group
