"""Gradient bucketing shared by data-parallel strategies (DDP, ZeRO, third-party ones)."""

from __future__ import annotations

from torch import nn


def assign_buckets(
    params: list[nn.Parameter], bucket_bytes: int, *, first_bucket_bytes: int | None = None
) -> list[list[nn.Parameter]]:
    """Group parameters (already in expected gradient-ready order) into buckets by size,
    never mixing dtypes or devices in one bucket.

    `first_bucket_bytes` caps the first bucket (torch DDP uses 1 MiB; never above
    `bucket_bytes`): its reduction can start as soon as the first few gradients of backward
    exist instead of after a full bucket's worth.
    """
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        kind_changes = current and (p.dtype, p.device) != (current[0].dtype, current[0].device)
        first = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
        cap = bucket_bytes if buckets else min(first, bucket_bytes)
        if current and (size + nbytes > cap or kind_changes):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
