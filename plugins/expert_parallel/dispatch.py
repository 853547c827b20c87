"""Token dispatch and combine for expert parallelism: all-to-all over the ep group.

A MoE layer hands `ExpertDispatch` its kept assignments sorted by global expert id (`x`, one
row per assignment) and the count per expert. Rank p of the ep group holds experts
`[p·L, (p+1)·L)` (L = experts per rank), so the rows for each destination are contiguous.

1. The per-expert counts are all-gathered (E integers per rank): every rank then knows what
   every rank sends to every other, so no second count exchange is needed.
2. Dispatch: one all-to-all with variable split sizes moves each destination's rows to it
   (`input_split_sizes[d]` = my rows for rank d's experts, `output_split_sizes[s]` = rank s's
   rows for mine): only real rows travel, no padding.
3. The received rows (source-major) are reordered expert-major (expert j's rows from every
   source together) and run through the local experts with one grouped GEMM.
4. Combine: the inverse reorder and the transposed all-to-all (splits swapped) bring every row
   back to its rank, in the order it was sent: the order `x` came in.

Both all-to-alls are autograd functions whose backward is the transposed exchange of the
gradient (the same all-to-all with input and output splits swapped).

Under `torch.compile` (the `compile` transform compiles each block) the whole exchange, the
local experts included, runs eagerly: a block's graph breaks at `run_experts`, Dynamo counts the
break, and the pieces before and after compile once. Traced, the split sizes (this step's token
counts, Python integers) and the communicator's counters would be guarded on, and the block
would recompile at every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from plait.core.comm import Comm, Group
from plait.core.comm_algorithms import MOE_COMBINE, MOE_DISPATCH


class _AllToAll(torch.autograd.Function):
    """Variable-split all-to-all of dim 0 over `group`; backward sends the gradient back."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        comm: Comm,
        group: Group,
        purpose: str,
        send: list[int],
        receive: list[int],
    ) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.purpose = comm, group, purpose
        ctx.send, ctx.receive = send, receive
        out = x.new_empty(sum(receive), *x.shape[1:])
        comm.all_to_all(
            out,
            x.contiguous(),
            group=group,
            input_split_sizes=send,
            output_split_sizes=receive,
            purpose=purpose,
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        ctx.comm.all_to_all(
            out,
            grad.contiguous(),
            group=ctx.group,
            input_split_sizes=ctx.receive,
            output_split_sizes=ctx.send,
            purpose=ctx.purpose,
        )
        return out, None, None, None, None, None


def all_to_all(
    x: torch.Tensor, comm: Comm, group: Group, purpose: str, send: list[int], receive: list[int]
) -> torch.Tensor:
    """`send[d]` rows of `x` (in order) to rank d of `group`; `receive[s]` rows from rank s."""
    return _AllToAll.apply(x, comm, group, purpose, send, receive)


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
        # Rows this rank sent to (received from) the ep group in forward dispatches since the
        # last `reset_counters` (the combine sends the received rows back; backward repeats both).
        self.rows_sent = 0
        self.rows_received = 0

    def reset_counters(self) -> None:
        self.rows_sent = self.rows_received = 0

    def gather_counts(self, counts: torch.Tensor) -> list[list[int]]:
        """counts[src][expert] over the ep group."""
        gathered = torch.empty(
            self.size * self.num_experts, dtype=torch.int64, device=counts.device
        )
        mine = counts.to(torch.int64).contiguous()
        self.comm.all_gather(gathered, mine, group=self.group, purpose=MOE_DISPATCH)
        return gathered.view(self.size, self.num_experts).tolist()

    @torch.compiler.disable
    def __call__(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        size, local, me = self.size, self.local, self.rank
        matrix = self.gather_counts(counts)
        # block[s][d]: rows source s sends to destination d.
        block = [[sum(row[d * local : (d + 1) * local]) for d in range(size)] for row in matrix]
        send = block[me]
        receive = [block[s][me] for s in range(size)]
        received = all_to_all(x, self.comm, self.group, MOE_DISPATCH, send, receive)

        # Received rows, expert-major: local expert j's rows from source 0, 1, …
        mine = [row[me * local : (me + 1) * local] for row in matrix]  # [source][local expert]
        source_start = [sum(receive[:s]) for s in range(size)]
        take: list[int] = []
        for j in range(local):
            for s in range(size):
                start = source_start[s] + sum(mine[s][:j])
                take.extend(range(start, start + mine[s][j]))
        local_counts = [sum(mine[s][j] for s in range(size)) for j in range(local)]
        take_index = torch.tensor(take, dtype=torch.long, device=x.device)
        expert_in = received.index_select(0, take_index)
        expert_out = self.experts(expert_in, torch.tensor(local_counts, device=counts.device))

        # Back to source-major order, then each source's rows home.
        back = torch.empty_like(expert_out).index_copy(0, take_index, expert_out)
        self.rows_sent += x.shape[0]
        self.rows_received += received.shape[0]
        return all_to_all(back, self.comm, self.group, MOE_COMBINE, receive, send)
