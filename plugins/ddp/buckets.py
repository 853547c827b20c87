"""Gradient buckets for DDP: flat buffers, readiness tracking and in-order async all-reduce."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from plait.core.buckets import assign_buckets
from plait.core.comm import Comm, Group, Work
from plait.core.comm_algorithms import GRAD_BUCKET, PARAM_SYNC
from plait.core.schedule import MicrobatchPosition
from plait.core.sharding import ParallelRuntime


@dataclass(eq=False)
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    offsets: list[int]
    group: Group
    ready: int = 0
    work: Work | None = None
    launched: bool = False
    views: list[torch.Tensor] = field(default_factory=list)


class BucketedAllReduce(ParallelRuntime):
    """The DDP runtime: owns gradient buffers and reduces them over the dp group."""

    name = "ddp"

    def __init__(
        self,
        module: nn.Module,
        *,
        comm: Comm,
        group: Group,
        bucket_bytes: int,
        broadcast_parameters: bool = True,
        group_of: Callable[[nn.Parameter], Group] | None = None,
    ) -> None:
        """`group_of(param)` picks a parameter's reduction group when it is not `group` (expert
        parameters are reduced over the expert-data-parallel group only)."""
        self.comm = comm
        self.group = group
        # Gradients become ready roughly in reverse registration order.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        pick = group_of or (lambda _: group)
        runs: list[tuple[Group, list[nn.Parameter]]] = []
        for p in params:  # a bucket never mixes groups: cut where the group changes
            if not runs or runs[-1][0] != pick(p):
                runs.append((pick(p), []))
            runs[-1][1].append(p)
        grouped = [(g, ps) for g, run in runs for ps in assign_buckets(run, bucket_bytes)]
        self.buckets = [self._make_bucket(i, ps, g) for i, (g, ps) in enumerate(grouped)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._sync_this_backward = True
        self._next_to_launch = 0
        self._reduces = any(b.group.size > 1 for b in self.buckets)
        if self._reduces:
            if broadcast_parameters:
                self._broadcast_parameters(module)
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _make_bucket(self, index: int, params: list[nn.Parameter], group: Group) -> Bucket:
        total = sum(p.numel() for p in params)
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        offsets, offset = [], 0
        bucket = Bucket(index=index, params=params, buffer=buffer, offsets=offsets, group=group)
        for p in params:
            offsets.append(offset)
            view = buffer[offset : offset + p.numel()].view_as(p)
            bucket.views.append(view)
            p.grad = view
            offset += p.numel()
        return bucket

    def _broadcast_parameters(self, module: nn.Module) -> None:
        # Each parameter from the first rank of its own group: replicas of other experts differ.
        with torch.no_grad():
            for bucket in self.buckets:
                for p in bucket.params:
                    if bucket.group.size > 1:
                        self.comm.broadcast(
                            p.data,
                            src=bucket.group.ranks[0],
                            group=bucket.group,
                            purpose=PARAM_SYNC,
                        )
            for tensor in module.buffers():
                self.comm.broadcast(
                    tensor.data, src=self.group.ranks[0], group=self.group, purpose=PARAM_SYNC
                )

    # -- hooks and launches ------------------------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync_this_backward:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Launch strictly in bucket order, so all ranks issue identical collective sequences.
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        self._restore_views(bucket)
        bucket.launched = True
        self._next_to_launch = bucket.index + 1
        if bucket.group.size == 1:  # a one-rank group (expert-dp at ep = dp) has nothing to do
            return
        bucket.work = self.comm.all_reduce(
            bucket.buffer,
            group=bucket.group,
            op="avg",
            async_op=True,
            purpose=GRAD_BUCKET,
            attributes={"bucket_index": bucket.index},
        )

    def _restore_views(self, bucket: Bucket) -> None:
        """If user code replaced a `.grad`, copy it back into the bucket before reducing."""
        for p, view in zip(bucket.params, bucket.views, strict=True):
            if p.grad is None:
                view.zero_()
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view

    # -- ParallelRuntime ---------------------------------------------------------------------

    def before_backward(self, position: MicrobatchPosition) -> None:
        # Gradients accumulate locally; the chunk's last backward (by the schedule's order, not
        # by micro-batch number) reduces the sum.
        self._sync_this_backward = position.last
        for bucket in self.buckets:
            bucket.ready = 0

    def sync_gradients(self) -> None:
        if not self._reduces:
            return
        # Parameters that got no gradient this step leave their bucket incomplete: reduce the
        # remaining buckets now (zeros for the unused parameters), still in order.
        while self._next_to_launch < len(self.buckets):
            self._launch(self.buckets[self._next_to_launch])
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.work, bucket.launched, bucket.ready = None, False, 0
        self._next_to_launch = 0
        self._sync_this_backward = True

    def zero_grad(self) -> bool:
        for bucket in self.buckets:
            bucket.buffer.zero_()
            self._restore_views(bucket)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"num_buckets": len(self.buckets)}
