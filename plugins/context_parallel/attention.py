"""The attention a context-parallel model runs: Ulysses all-to-all, ring, or both (hybrid).

`ContextParallelAttention` is what the strategy installs as each attention module's
`attend(q, k, v)`: q/k/v hold this rank's positions of every sequence, all local heads. With a
Ulysses group, heads are exchanged for positions first (the group's positions are then one ring
position's chunks, in order); with a ring of more than one position, blocks go round it;
otherwise the positions are the whole sequence and plain causal attention from the kernel
facade does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.core.kernels import Kernels
from plait.plugins.context_parallel.ring import Ring, ring_attention
from plait.plugins.context_parallel.ulysses import (
    HeadExchange,
    check_heads,
    heads_to_sequence,
    kv_repeats,
    sequence_to_heads,
)


@dataclass(frozen=True, slots=True)
class ContextParallelAttention:
    kernels: Kernels
    ring: Ring | None = None  # None: a ring of one position
    exchange: HeadExchange | None = None  # None: no Ulysses all-to-all

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.exchange is not None:
            degree = self.exchange.size
            heads, kv_heads = q.shape[1], k.shape[1]
            check_heads(heads, kv_heads, degree, where="context parallel attention")
            repeats = kv_repeats(heads, kv_heads, degree)
            if repeats > 1:
                k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            q, k, v = (sequence_to_heads(t, self.exchange) for t in (q, k, v))
        if self.ring is not None:
            out = ring_attention(self.ring, q, k, v)
        else:
            out = self.kernels.get("attention", q.device, q.dtype)(q, k, v, causal=True)
        if self.exchange is not None:
            out = heads_to_sequence(out, self.exchange)
        return out
