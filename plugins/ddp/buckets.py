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
        first_bucket_bytes: int | None = None,
        rebuild_buckets: bool = True,
    ) -> None:
        """`group_of(param)` picks a parameter's reduction group when it is not `group` (expert
        parameters are reduced over the expert-data-parallel group only). `first_bucket_bytes`
        caps the first bucket, so the first reduction starts early in backward."""
        self.comm = comm
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.first_bucket_bytes = first_bucket_bytes
        self._group_of = group_of or (lambda _: group)
        # Frozen parameters (a LoRA base, `requires_grad=False`) get no bucket, no gradient
        # buffer and no reduction: only what trains costs memory and bandwidth.
        self._params = [p for p in module.parameters() if p.requires_grad]
        # Gradients become ready roughly in reverse registration order; the first backward
        # records the real order and the buckets are rebuilt in it (`rebuild_buckets`).
        self._install_buckets(self._params[::-1])
        self._sync_this_backward = True
        self._next_to_launch = 0
        self._reduces = any(b.group.size > 1 for b in self.buckets)
        self._recording: dict[int, nn.Parameter] | None = {} if rebuild_buckets else None
        self._observed: list[nn.Parameter] | None = None
        if self._reduces:
            if broadcast_parameters:
                self._broadcast_parameters(module)
            for p in self._params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _install_buckets(self, ordered: list[nn.Parameter]) -> None:
        """Cut `ordered` (expected gradient-ready order) into buckets, each a flat buffer that
        the parameters' `.grad` are views of; a bucket never mixes reduction groups."""
        runs: list[tuple[Group, list[nn.Parameter]]] = []
        for p in ordered:  # cut where the group changes
            if not runs or runs[-1][0] != self._group_of(p):
                runs.append((self._group_of(p), []))
            runs[-1][1].append(p)
        grouped, first = [], self.first_bucket_bytes
        for g, run in runs:
            for ps in assign_buckets(run, self.bucket_bytes, first_bucket_bytes=first):
                grouped.append((g, ps))
                first = None  # only the very first bucket of the step is small
        self.buckets = [self._make_bucket(i, ps, g) for i, (g, ps) in enumerate(grouped)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def _rebuild_in_observed_order(self, observed: list[nn.Parameter]) -> None:
        """Rebuild the buckets in the order the first backward produced gradients (as torch
        DDP does after its first iteration), so each bucket fills up in one stretch of backward
        and the first one launches early. Rank 0's order is used everywhere (a collective), so
        every rank keeps issuing identical reductions; parameters without a gradient go last."""
        seen = {id(p) for p in observed}
        order = observed + [p for p in self._params[::-1] if id(p) not in seen]
        index = {id(p): i for i, p in enumerate(self._params)}
        indices = torch.tensor([index[id(p)] for p in order], dtype=torch.int64)
        if self.group.size > 1:
            self.comm.broadcast(
                indices, src=self.group.ranks[0], group=self.group, purpose=PARAM_SYNC
            )
        order = [self._params[i] for i in indices.tolist()]
        if [id(p) for p in order] == [id(p) for b in self.buckets for p in b.params]:
            return
        self._install_buckets(order)

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
        # Frozen parameters too (a LoRA base): they have no bucket, but every replica must
        # compute with the same values.
        with torch.no_grad():
            for p in module.parameters():
                group = self._group_of(p)
                if group.size > 1:
                    self.comm.broadcast(p.data, src=group.ranks[0], group=group, purpose=PARAM_SYNC)
            for tensor in module.buffers():
                self.comm.broadcast(
                    tensor.data, src=self.group.ranks[0], group=self.group, purpose=PARAM_SYNC
                )

    # -- hooks and launches ------------------------------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if self._recording is not None:
            self._recording.setdefault(id(param), param)  # first time each one is ready
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
        if self._recording is not None:  # the first step's order is known: rebuild after it
            self._observed, self._recording = list(self._recording.values()), None

    def zero_grad(self) -> bool:
        if self._observed is not None:  # gradients are consumed: the buffers may be replaced
            observed, self._observed = self._observed, None
            self._rebuild_in_observed_order(observed)
        for bucket in self.buckets:
            bucket.buffer.zero_()
            self._restore_views(bucket)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"num_buckets": len(self.buckets)}
