"""fp16 / bf16 gradient-bucket compression: all-reduce in half precision, cast back.

Halves the bytes on the wire. fp16 has a narrow range, so for an average the bucket is divided by
the group size *before* the cast (as PyTorch's `fp16_compress_hook` does) and the half-precision
sum cannot overflow where the full-precision sum would not. bf16 keeps fp32's range but only 8
bits of mantissa. The inner all-reduce is issued asynchronously; the cast back runs when the
caller waits, so the bucket overlaps with whatever the caller does next (backward, say).
"""

from __future__ import annotations

import torch

from plait.core.comm import ChainedWork, Comm, Group, Work


def cast_all_reduce(
    comm: Comm,
    tensor: torch.Tensor,
    *,
    wire_dtype: torch.dtype,
    prescale: bool,
    group: Group,
    reduce_op: str,
    purpose: str,
) -> Work:
    """Start an all-reduce of `tensor` carried in `wire_dtype`; `wait()` writes the result back."""
    if prescale and reduce_op == "avg":
        compressed = (tensor / group.size).to(wire_dtype)
        wire_op = "sum"
    else:
        compressed = tensor.to(wire_dtype)
        wire_op = reduce_op
    inner = comm.all_reduce(compressed, group=group, op=wire_op, async_op=True, purpose=purpose)

    def decompress() -> None:
        tensor.copy_(compressed)

    return ChainedWork(inner, decompress)
