"""Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023): all-to-all from sequence shards to head shards.

Before attention each rank of a Ulysses group of `u` ranks holds all heads of `1/u` of the
positions; one all-to-all (purpose `cp_a2a`) gives it `1/u` of the heads over all the group's
positions, attention runs locally, and the inverse all-to-all brings the output back. Both
directions are autograd functions whose backward is the other direction.

Grouped-query attention: key/value heads are split like the query heads when the group size
divides them; otherwise each is repeated the fewest times that make it divide (as Megatron
replicates KV heads), so every query head still meets its own key/value head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from plait.core.comm import Comm, Group
from plait.core.comm_algorithms import CP_A2A
from plait.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class HeadExchange:
    """The all-to-alls of one Ulysses group."""

    comm: Comm
    group: Group

    @property
    def size(self) -> int:
        return self.group.size

    def _all_to_all(self, pieces: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(pieces)
        self.comm.all_to_all(received, pieces, group=self.group, purpose=CP_A2A)
        return received

    def sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, seq, d) on every rank -> (batch, heads / u, u · seq, d)."""
        batch, heads, seq, dim = x.shape
        local = heads // self.size
        pieces = x.reshape(batch, self.size, local, seq, dim).transpose(0, 1).contiguous()
        received = self._all_to_all(pieces)  # [r] = rank r's positions of my heads
        return received.permute(1, 2, 0, 3, 4).reshape(batch, local, self.size * seq, dim)

    def heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads / u, u · seq, d) -> (batch, heads, seq, d), the inverse."""
        batch, local, length, dim = x.shape
        seq = length // self.size
        pieces = x.reshape(batch, local, self.size, seq, dim).permute(2, 0, 1, 3, 4).contiguous()
        received = self._all_to_all(pieces)  # [r] = rank r's heads of my positions
        return received.transpose(0, 1).reshape(batch, self.size * local, seq, dim)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, exchange: HeadExchange) -> torch.Tensor:
        ctx.exchange = exchange
        return exchange.sequence_to_heads(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.exchange.heads_to_sequence(grad.contiguous()), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, exchange: HeadExchange) -> torch.Tensor:
        ctx.exchange = exchange
        return exchange.heads_to_sequence(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.exchange.sequence_to_heads(grad.contiguous()), None


def sequence_to_heads(x: torch.Tensor, exchange: HeadExchange) -> torch.Tensor:
    return _SequenceToHeads.apply(x, exchange)


def heads_to_sequence(x: torch.Tensor, exchange: HeadExchange) -> torch.Tensor:
    return _HeadsToSequence.apply(x, exchange)


def kv_repeats(heads: int, kv_heads: int, degree: int) -> int:
    """How many times each key/value head is repeated so `degree` ranks can split them."""
    return degree // math.gcd(kv_heads, degree)


def check_heads(heads: int, kv_heads: int, degree: int, *, where: str) -> None:
    """A Ulysses degree must divide the query heads this rank holds (after tensor parallel)."""
    if heads % degree:
        raise ConfigError(
            f"{where}: the Ulysses degree {degree} does not divide the {heads} query heads each "
            f"rank holds; all-to-all context parallelism splits heads. Use "
            f"parallel.cp_strategy = 'ring' (splits the sequence only), or 'hybrid' with "
            f"[cp] ulysses_degree a divisor of {heads}"
        )
    if heads % (kv_heads * kv_repeats(heads, kv_heads, degree)):
        raise ConfigError(
            f"{where}: {kv_heads} key/value heads cannot be shared out over {degree} ranks "
            f"with {heads} query heads; use parallel.cp_strategy = 'ring' or 'hybrid'"
        )
