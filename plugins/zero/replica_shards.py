"""`[zero] shard_optimizer_across_replicas`: HSDP's ZeRO-1/2 with the optimizer state sharded
over every dp rank, not only over the shard group (Megatron-FSDP's `optim` sharding, Megatron's
distributed optimizer with one instance).

Under HSDP (`parallel.dp_shard = k`, `m = dp / k` replicas) stages 1 and 2 reduce each bucket
over the shard group into this rank's chunk of `c = P/k` elements, which every replica holds
alike. Here the chunk is split once more, into `m` sub-chunks of `c/m`: replica `j` of shard
`i` owns sub-chunk `i·m + j` of the bucket, `[i·c + j·c/m, i·c + (j+1)·c/m)`, so its fp32
master and Adam moments hold `P/(k·m)` elements instead of `P/k`. Once per optimizer step:

    reduce-scatter across the replicas   chunk (c)   -> this rank's sub-chunk (c/m), averaged
    optimizer step on the sub-chunk
    all-gather across the replicas       sub-chunk   -> the updated chunk (c)
    all-gather inside the shard group    chunk       -> the whole bucket (P)

The replica reduce-scatter plus all-gather send exactly the bytes of the all-reduce it
replaces (`(m−1)·⌈c/m⌉` elements each against `2·(m−1)·⌈c/m⌉` for a ring all-reduce;
`plait.plugins.collectives.step_bytes.replica_step_bytes`), so the cross-node bytes per step
stay `2·(m−1)·B` while the optimizer state per rank drops from `8·P/k` to `8·P/(k·m)` bytes
(fp32 AdamW). Buckets are padded to a multiple of `k·m` so every sub-chunk has the same length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.core.comm import Comm, Group, Work
from plait.core.comm_algorithms import GRAD_SHARD, OPTIMIZER_STATE, PARAM_GATHER
from plait.plugins.zero.flat_buffer import Segment
from plait.plugins.zero.reduction import ensure_allocated, release

__all__ = ["ReplicaShards"]


class ReplicaShards:
    """This rank's sub-chunks of the shard-group segments (`segments`, each built with a
    padding multiple of `k·m`) and the collectives across `replicas` that feed and publish
    them."""

    def __init__(
        self, segments: Sequence[Segment], *, comm: Comm, replicas: Group, rank: int
    ) -> None:
        m = replicas.size
        replica = replicas.rank_of(rank)
        for segment in segments:
            if segment.padded_numel % (segment.world_size * m):
                raise ValueError(
                    f"segment {segment.index} is padded to {segment.padded_numel} elements, "
                    f"not a multiple of {segment.world_size} x {m} ranks"
                )
        self.comm, self.replicas = comm, replicas
        self.shard_segments = list(segments)
        # The same parameters seen by dp = k·m ranks, in shard-major order.
        self.segments = [
            Segment(
                s.index,
                [(slot.name, slot.param) for slot in s.slots],
                world_size=s.world_size * m,
                rank=s.rank * m + replica,
            )
            for s in segments
        ]
        self.grad_chunks = [
            torch.zeros(s.chunk_numel, dtype=s.dtype, device=s.device) for s in self.segments
        ]

    def param_chunks(self, flat_params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's sub-chunk of each bucket's flat parameters (views)."""
        return [s.chunk_of(f) for s, f in zip(self.segments, flat_params, strict=True)]

    def reduce_scatter_gradients(self, shard_grad_chunks: Sequence[torch.Tensor]) -> None:
        """Average each shard-group gradient chunk across the replicas into this rank's
        sub-chunk: all buckets in flight together, once per step."""
        pending: list[tuple[torch.Tensor, Work]] = []
        for chunk, sub in zip(shard_grad_chunks, self.grad_chunks, strict=True):
            ensure_allocated(sub)
            work = self.comm.reduce_scatter(
                sub, chunk, group=self.replicas, op="sum", async_op=True, purpose=GRAD_SHARD
            )
            pending.append((sub, work))
        for sub, work in pending:
            work.wait()
            sub.mul_(1 / self.replicas.size)

    def gather_parameters(self, flat_params: Sequence[torch.Tensor]) -> None:
        """Publish the updated sub-chunks: across the replicas into each shard chunk, then
        inside the shard group into the whole bucket."""
        subs = [sub.clone() for sub in self.param_chunks(flat_params)]  # inputs must not alias
        works = [
            self.comm.all_gather(
                s.chunk_of(flat), sub, group=self.replicas, async_op=True, purpose=PARAM_GATHER
            )
            for s, flat, sub in zip(self.shard_segments, flat_params, subs, strict=True)
        ]
        for work in works:
            work.wait()
        pending = []
        for segment, flat in zip(self.shard_segments, flat_params, strict=True):
            group = _group(segment)
            if group.size == 1:
                continue
            chunk = segment.chunk_of(flat).clone()
            work = self.comm.all_gather(
                flat, chunk, group=group, async_op=True, purpose=PARAM_GATHER
            )
            pending.append((chunk, work))
        for _, work in pending:
            work.wait()

    def gather_state(self, index: int, whole: torch.Tensor, sub_chunk: torch.Tensor) -> None:
        """`whole` (bucket `index`, padded) receives every rank's `sub_chunk` of one optimizer
        state tensor: across the replicas, then inside the shard group."""
        segment = self.shard_segments[index]
        chunk = torch.empty(segment.chunk_numel, dtype=whole.dtype, device=whole.device)
        self.comm.all_gather(chunk, sub_chunk, group=self.replicas, purpose=OPTIMIZER_STATE)
        group = _group(segment)
        if group.size == 1:
            whole.copy_(chunk)
        else:
            self.comm.all_gather(whole, chunk, group=group, purpose=OPTIMIZER_STATE)

    def release_gradients(self) -> None:
        for sub in self.grad_chunks:
            release(sub)


def _group(segment: Segment) -> Group:
    assert segment.group is not None, "ZeRO stage 1/2 segments are built with their group"
    return segment.group
