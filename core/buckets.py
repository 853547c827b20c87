"""Gradient bucketing shared by data-parallel strategies (DDP, ZeRO, third-party ones)."""

from __future__ import annotations

from torch import nn


def assign_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters (already in expected gradient-ready order) into buckets by size,
    never mixing dtypes or devices in one bucket."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        kind_changes = current and (p.dtype, p.device) != (current[0].dtype, current[0].device)
        if current and (size + nbytes > bucket_bytes or kind_changes):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
