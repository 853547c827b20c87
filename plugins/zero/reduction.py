"""Reducing one full gradient bucket into this rank's gradient chunk (ZeRO stages 2 and 3).

The textbook collective is a reduce-scatter with a mean. On Gloo (CPU tensors) plait issues an
in-place all-reduce of the bucket instead and keeps its own chunk: measured on 2 and 4 Gloo
ranks, `reduce_scatter_tensor` is slower than an all-reduce of the very same buffer (8.9 ms vs
6.1 ms for 1.3 M floats on 2 ranks, 18 ms vs 11 ms on 4) and spends 2–9 ms of it in the calling
thread, i.e. blocking backward. The sum is also cheaper than a mean there: Gloo divides a copy
of the input before it sends, again in the calling thread, so plait sums and folds the `1/d`
into the copy or addition that moves the chunk out of the bucket. The bucket is full-size either
way, so the peak memory is the same. NCCL keeps the real reduce-scatter with a mean.
`[zero] gradient_reduction = "reduce_scatter"` takes the reduce-scatter path on Gloo too, so the
path GPUs always take (and every comm algorithm's handling of it) is tested on CPU.

Both carry purpose `GRAD_BUCKET` and the segment's `bucket_index`, so a comm algorithm that
keeps per-bucket state (PowerSGD, top-k, a parameter server) tells the buckets apart.

Gradient accumulation is sharded: the first micro-batch's reduction writes the chunk, later
ones are added to it.

Under HSDP (`parallel.dp_shard`) the chunks so reduced are the mean over the shard group only;
`average_across_replicas` makes them the mean over all of dp, once per optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.core.comm import QUANTIZE, QUANTIZE_BLOCK, Comm, Group, Work
from plait.core.comm_algorithms import GRAD_BUCKET, GRAD_SHARD
from plait.plugins.zero.flat_buffer import Segment


def reduces_by_all_reduce(device: torch.device, method: str = "auto") -> bool:
    """Whether buckets on `device` are reduced by all-reduce rather than reduce-scatter: on
    Gloo (CPU tensors) unless `method` is "reduce_scatter"."""
    return method == "auto" and device.type == "cpu"


@dataclass(eq=False, slots=True)
class PendingReduction:
    """A bucket's reduction in flight; `complete()` lands it in the gradient chunk."""

    segment: Segment
    bucket: torch.Tensor  # kept alive until the collective is done
    grad_chunk: torch.Tensor
    accumulate: bool
    work: Work | None
    # Reduce-scatter: its output when accumulating (added on completion), else None because
    # it wrote the chunk directly. All-reduce (or one rank): None, the result is in `bucket`.
    received: torch.Tensor | None = None
    in_bucket_scale: float | None = None  # all-reduce: the 1/d applied when leaving the bucket

    def complete(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.in_bucket_scale is not None:
            reduced = self.segment.chunk_of(self.bucket)
            if self.accumulate:
                self.grad_chunk.add_(reduced, alpha=self.in_bucket_scale)
            else:
                torch.mul(reduced, self.in_bucket_scale, out=self.grad_chunk)
        elif self.received is not None:
            self.grad_chunk.add_(self.received)


def launch_reduction(
    comm: Comm,
    group: Group,
    segment: Segment,
    bucket: torch.Tensor,
    grad_chunk: torch.Tensor,
    *,
    accumulate: bool,
    method: str = "auto",
    codec: dict[str, str | int] | None = None,
) -> PendingReduction:
    """Start reducing the whole-segment `bucket` (this rank's unreduced gradients) across
    `group` into `grad_chunk`, overwriting it or, with `accumulate`, adding to it.

    `method` is `[zero] gradient_reduction`; `codec` (the `QUANTIZE` attributes of qgZ) takes
    the reduce-scatter, whose cross-node hop is the one encoded."""
    if group.size == 1:
        return PendingReduction(segment, bucket, grad_chunk, accumulate, None, None, 1.0)
    attributes: dict[str, str | int] = {"bucket_index": segment.index, **(codec or {})}
    if codec is None and reduces_by_all_reduce(bucket.device, method):
        work = comm.all_reduce(
            bucket,
            group=group,
            op="sum",
            async_op=True,
            purpose=GRAD_BUCKET,
            attributes=attributes,
        )
        return PendingReduction(segment, bucket, grad_chunk, accumulate, work, None, 1 / group.size)
    received = torch.empty_like(grad_chunk) if accumulate else None
    work = comm.reduce_scatter(
        received if received is not None else grad_chunk,
        bucket,
        group=group,
        op="avg",
        async_op=True,
        purpose=GRAD_BUCKET,
        attributes=attributes,
    )
    return PendingReduction(segment, bucket, grad_chunk, accumulate, work, received)


def codec_attributes(codec: str | None, block: int) -> dict[str, str | int] | None:
    """The request attributes asking for a ZeRO++ codec on an op's cross-node hop, or None."""
    return None if codec is None else {QUANTIZE: codec, QUANTIZE_BLOCK: block}


def ensure_allocated(chunk: torch.Tensor) -> bool:
    """Give back `chunk` (which owns its whole storage) the memory `release` took, if it did;
    the contents are then undefined, so the first reduction of a step overwrites rather than
    adds. True if memory was allocated."""
    storage = chunk.untyped_storage()
    if storage.nbytes() == 0 and chunk.numel():
        storage.resize_(chunk.numel() * chunk.element_size())
        return True
    return False


def release(chunk: torch.Tensor) -> None:
    """Free `chunk`'s memory while keeping the tensor (and every view of it, such as the
    optimizer parameters' `.grad`) valid for `ensure_allocated`."""
    chunk.untyped_storage().resize_(0)


def average_across_replicas(comm: Comm, replicas: Group | None, chunks: list[torch.Tensor]) -> None:
    """HSDP: average each gradient chunk (the mean over its shard group, summed over the
    step's micro-batches) with the other replicas' copies of the same chunk, so that it is the
    gradient of the global loss. Once per step, all chunks in flight together; nothing to do
    without replicas."""
    if replicas is None or replicas.size == 1:
        return
    pending = [
        (chunk, comm.all_reduce(chunk, group=replicas, op="sum", async_op=True, purpose=GRAD_SHARD))
        for chunk in chunks
    ]
    for chunk, work in pending:
        work.wait()
        chunk.mul_(1 / replicas.size)
