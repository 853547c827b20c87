"""Recursive halving-doubling all-reduce (Rabenseifner), for any group size.

For a power-of-two group of `p` ranks:

- large messages: reduce-scatter by recursive *halving* — at distance `p/2, p/4, …, 1` each rank
  swaps half of its current range with the partner whose index differs in that bit and keeps
  reducing the other half — then all-gather by recursive *doubling*, the same exchanges in
  reverse. `log2 p` steps each way; each rank sends `2 (p - 1) / p` of the tensor, like the ring,
  but in `2 log2 p` instead of `2 (p - 1)` messages.
- small messages (below `small_message_bytes`): recursive doubling on the whole vector, `log2 p`
  steps of full exchanges — fewer, larger messages win when latency dominates (MPICH's choice).

Other sizes fold in first (Thakur, Rabenseifner & Gropp, 2005): with `p'` the largest power of two
below the size and `r = size - p'`, the first `2r` ranks pair up, the even one hands its vector to
the odd one and sits out; the `p'` remaining ranks run the algorithm; the odd ranks hand the
result back at the end.

Every combination step is commutative (`a + b` on one side, `b + a` on the other), so all ranks
end with bit-identical results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.core.comm import Comm, Group
from plait.plugins.collectives.p2p import (
    exchange,
    flat_working_copy,
    reduce_into,
    write_back,
)

DEFAULT_SMALL_MESSAGE_BYTES = 16 * 1024


@dataclass(frozen=True, slots=True)
class _Core:
    """The power-of-two set of ranks that runs the exchanges after folding."""

    comm: Comm
    group: Group
    purpose: str
    reduce_op: str
    index: int  # this rank's index among the core ranks
    size: int  # a power of two
    extra: int  # ranks folded away: group size - core size

    def global_rank(self, core_index: int) -> int:
        # The first `extra` core ranks are the odd ranks that absorbed an even neighbour.
        group_index = 2 * core_index + 1 if core_index < self.extra else core_index + self.extra
        return self.group.ranks[group_index]

    def swap(self, partner: int, send: torch.Tensor, recv: torch.Tensor) -> None:
        peer = self.global_rank(partner)
        exchange(
            self.comm,
            group=self.group,
            purpose=self.purpose,
            send=send,
            dst=peer,
            recv=recv,
            src=peer,
        )


def halving_doubling_all_reduce(
    comm: Comm,
    tensor: torch.Tensor,
    *,
    group: Group,
    rank: int,
    reduce_op: str,
    purpose: str,
    small_message_bytes: int = DEFAULT_SMALL_MESSAGE_BYTES,
) -> None:
    """All-reduce `tensor` in place over `group` by recursive halving-doubling.

    `rank` is this process's global rank.
    """
    size = group.size
    if size == 1 or tensor.numel() == 0:
        return
    flat = flat_working_copy(tensor)
    me = group.rank_of(rank)
    core_size = 1 << (size.bit_length() - 1)
    extra = size - core_size
    scratch = torch.empty_like(flat)

    def neighbour(offset: int) -> int:
        return group.ranks[me + offset]

    # Fold the group down to a power of two.
    core_index: int | None = me - extra
    if me < 2 * extra:
        if me % 2 == 0:
            exchange(comm, group=group, purpose=purpose, send=flat, dst=neighbour(+1))
            core_index = None
        else:
            exchange(comm, group=group, purpose=purpose, recv=scratch, src=neighbour(-1))
            reduce_into(flat, scratch, reduce_op)
            core_index = me // 2

    if core_index is not None:
        core = _Core(comm, group, purpose, reduce_op, core_index, core_size, extra)
        if flat.numel() * flat.element_size() < small_message_bytes:
            _recursive_doubling(core, flat, scratch)
        else:
            _recursive_halving_doubling(core, flat, scratch)

    # Unfold: the ranks that sat out receive the result from their odd neighbour.
    if me < 2 * extra:
        if me % 2 == 0:
            exchange(comm, group=group, purpose=purpose, recv=flat, src=neighbour(+1))
        else:
            exchange(comm, group=group, purpose=purpose, send=flat, dst=neighbour(-1))
    write_back(tensor, flat)


def _recursive_doubling(core: _Core, flat: torch.Tensor, scratch: torch.Tensor) -> None:
    distance = 1
    while distance < core.size:
        core.swap(core.index ^ distance, send=flat, recv=scratch)
        reduce_into(flat, scratch, core.reduce_op)
        distance <<= 1
    if core.reduce_op == "avg":
        flat.div_(core.size + core.extra)


def _recursive_halving_doubling(core: _Core, flat: torch.Tensor, scratch: torch.Tensor) -> None:
    low, high = 0, flat.numel()
    # (partner, kept range, given range) per halving step, replayed backwards to gather.
    steps: list[tuple[int, tuple[int, int], tuple[int, int]]] = []
    distance = core.size >> 1
    while distance:
        middle = low + (high - low) // 2
        lower, upper = (low, middle), (middle, high)
        kept, given = (upper, lower) if core.index & distance else (lower, upper)
        partner = core.index ^ distance
        incoming = scratch[: kept[1] - kept[0]]
        core.swap(partner, send=flat[given[0] : given[1]], recv=incoming)
        reduce_into(flat[kept[0] : kept[1]], incoming, core.reduce_op)
        steps.append((partner, kept, given))
        low, high = kept
        distance >>= 1

    if core.reduce_op == "avg":
        flat[low:high].div_(core.size + core.extra)

    # The partner kept exactly the range this rank gave away, and now holds it reduced.
    for partner, kept, given in reversed(steps):
        core.swap(partner, send=flat[kept[0] : kept[1]], recv=flat[given[0] : given[1]])
