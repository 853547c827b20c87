"""Top-k sparsification with error feedback (Stich et al., 2018; Lin et al., "Deep Gradient
Compression", 2018).

Each rank sends only the `k = ceil(ratio · n)` entries of largest magnitude, with their indices,
in one all-gather of a packed byte buffer (values in the gradient's dtype, then int32 indices —
int64 for buckets of 2³¹ elements or more). Every rank then scatters all ranks' entries into a
dense bucket. The entries a rank did not send are kept and added to its next gradient (error
feedback), so nothing is lost, only delayed; without it top-k at 1% does not converge.

Bytes per rank: `k · (value size + index size)` instead of `n · value size`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plait.core.comm import ChainedWork, Comm, Group, Work


@dataclass(slots=True)
class TopKState:
    """What one bucket carries from step to step: the entries it has not sent yet."""

    error: torch.Tensor | None = None


def topk_count(numel: int, ratio: float) -> int:
    return min(numel, max(1, math.ceil(ratio * numel)))


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def topk_all_reduce(
    comm: Comm,
    tensor: torch.Tensor,
    *,
    state: TopKState,
    ratio: float,
    error_feedback: bool,
    group: Group,
    reduce_op: str,
    purpose: str,
) -> Work:
    """Start a sparse all-reduce of `tensor`; `wait()` writes the dense result into it."""
    numel, dtype = tensor.numel(), tensor.dtype
    accumulated = tensor.detach().reshape(-1).to(torch.float32, copy=True)
    if error_feedback and state.error is not None:
        accumulated += state.error
    k = topk_count(numel, ratio)
    indices = accumulated.abs().topk(k, sorted=False).indices
    values = accumulated[indices].to(dtype)
    if error_feedback:
        # What was not sent, including the rounding of what was, carries over to the next step.
        accumulated[indices] -= values.to(torch.float32)
        state.error = accumulated
    indices = indices.to(index_dtype(numel))
    value_bytes = k * values.element_size()
    payload = torch.cat([values.view(torch.uint8), indices.view(torch.uint8)])
    gathered = torch.empty(group.size * payload.numel(), dtype=torch.uint8, device=tensor.device)
    inner = comm.all_gather(gathered, payload, group=group, async_op=True, purpose=purpose)

    def decompress() -> None:
        per_rank = gathered.view(group.size, -1)
        all_values = per_rank[:, :value_bytes].contiguous().view(dtype).reshape(-1)
        all_indices = per_rank[:, value_bytes:].contiguous().view(indices.dtype).reshape(-1)
        dense = torch.zeros(numel, dtype=torch.float32, device=tensor.device)
        dense.index_add_(0, all_indices.long(), all_values.to(torch.float32))
        if reduce_op == "avg":
            dense /= group.size
        tensor.copy_(dense.view(tensor.shape))

    return ChainedWork(inner, decompress)
