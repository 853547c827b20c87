"""Token dispatch and combine for expert parallelism: all-to-all over the ep group.

A MoE layer hands `ExpertDispatch` its kept assignments sorted by global expert id (`x`, one
row per assignment) and the count per expert. Rank p of the ep group holds experts
`[p·L, (p+1)·L)` (L = experts per rank), so the rows for each destination are contiguous.

1. The per-expert counts are all-gathered (E integers per rank): every rank then knows what
   every rank sends to every other, so no second count exchange is needed.
2. Dispatch: one all-to-all moves each destination's rows to it. `Comm.all_to_all` has equal
   splits, so each (source, destination) block is padded to the largest block in the group;
   the padding is the only overhead over a variable-split all-to-all (`bytes_per_step` in the
   bench reports both).
3. The received rows are reordered expert-major (expert j's rows from every source together)
   and run through the local experts with one grouped GEMM.
4. Combine: the inverse reorder, one all-to-all back, and the rows are returned in the order
   they came in.

Both all-to-alls are autograd functions whose backward is the same all-to-all of the gradient
(an equal-split all-to-all is its own transpose).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait.core.comm import Comm, Group
from plait.core.comm_algorithms import MOE_COMBINE, MOE_DISPATCH


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all of dim 0 over `group`; backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, group: Group, purpose: str) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.purpose = comm, group, purpose
        out = torch.empty_like(x)
        comm.all_to_all(out, x.contiguous(), group=group, purpose=purpose)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad.contiguous(), group=ctx.group, purpose=ctx.purpose)
        return out, None, None, None


def all_to_all(x: torch.Tensor, comm: Comm, group: Group, purpose: str) -> torch.Tensor:
    return _AllToAll.apply(x, comm, group, purpose)


class ExpertDispatch:
    """`run_experts` of one MoE layer under expert parallelism (a plain callable, not a
    module, so the experts' parameters stay registered once, under the layer)."""

    def __init__(
        self,
        experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        comm: Comm,
        group: Group,
        rank: int,
        num_experts: int,
    ) -> None:
        self.experts, self.comm, self.group = experts, comm, group
        self.rank, self.size, self.num_experts = rank, group.size, num_experts
        self.local = num_experts // group.size
        self.padded_rows = 0  # rows this rank sent in the last dispatch, padding included
        self.sent_rows = 0  # rows it would send without padding

    def gather_counts(self, counts: torch.Tensor) -> list[list[int]]:
        """counts[src][expert] over the ep group."""
        gathered = torch.empty(
            self.size * self.num_experts, dtype=torch.int64, device=counts.device
        )
        mine = counts.to(torch.int64).contiguous()
        self.comm.all_gather(gathered, mine, group=self.group, purpose=MOE_DISPATCH)
        return gathered.view(self.size, self.num_experts).tolist()

    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        size, local, me = self.size, self.local, self.rank
        matrix = self.gather_counts(counts)
        # block[s][d]: rows source s sends to destination d.
        block = [[sum(row[d * local : (d + 1) * local]) for d in range(size)] for row in matrix]
        chunk = max(1, max(max(row) for row in block))
        device = x.device

        # Where each of my sorted rows goes in the padded send buffer.
        send_slots: list[int] = []
        for d in range(size):
            send_slots.extend(range(d * chunk, d * chunk + block[me][d]))
        send_index = torch.tensor(send_slots, dtype=torch.long, device=device)
        padded = x.new_zeros(size * chunk, x.shape[1]).index_copy(0, send_index, x)
        received = all_to_all(padded, self.comm, self.group, MOE_DISPATCH)

        # Received rows, expert-major: local expert j's rows from source 0, 1, …
        take: list[int] = []
        local_counts = [0] * local
        for j in range(local):
            for s in range(size):
                row = matrix[s]
                start = s * chunk + sum(row[me * local : me * local + j])
                n = row[me * local + j]
                take.extend(range(start, start + n))
                local_counts[j] += n
        take_index = torch.tensor(take, dtype=torch.long, device=device)
        expert_in = received.index_select(0, take_index)
        expert_out = self.experts(expert_in, torch.tensor(local_counts, device=counts.device))

        back = expert_out.new_zeros(size * chunk, expert_out.shape[1]).index_copy(
            0, take_index, expert_out
        )
        returned = all_to_all(back, self.comm, self.group, MOE_COMBINE)
        self.padded_rows, self.sent_rows = size * chunk, x.shape[0]
        return returned.index_select(0, send_index)
