"""Ring attention: causal attention over a sequence whose chunks are spread over a ring of ranks.

Each rank keeps its query chunks and passes its key/value chunks around the ring, one hop per
step, through `plait.core.comm` (purpose `cp_kv`): the receive of the next block and the send
of the current one are posted before the current block's attention runs, so the transfer
overlaps the compute. Blocks are merged with the log-sum-exp rule

    lse = logaddexp(lse_a, lse_b),  out = e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b,

which is exact: attention over keys [A; B] is that mix of attention over A and over B.

Which block pairs are computed follows from the chunks' global order alone: a query chunk sees
an earlier key chunk whole, its own chunk causally, a later one not at all. With the
load-balanced layout (ring position j holds chunks j and 2·R − 1 − j of 2·R) every position
computes the same number of score entries; with one contiguous chunk per position the last
does R times the work of the first.

Backward (a custom autograd function, as in Liu et al. 2023 and ring-flash-attention): the
key/value blocks go round again, and with them the partial dK/dV of each block, accumulated by
every rank the block visits and delivered to its owner by one final hop. Each block's
attention is recomputed through the kernel facade and differentiated with the gradients the
merge gives its output and its log-sum-exp (the kernels' `return_lse` contract).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.core.comm import Comm, Group
from plait.core.comm_algorithms import CP_KV
from plait.core.kernels import Kernels

BlockPair = tuple[int, int, bool]  # (local query chunk, local key chunk, causal)


def block_pairs(query_chunks: tuple[int, ...], key_chunks: tuple[int, ...]) -> list[BlockPair]:
    """The (query, key) chunk pairs causal attention needs, by the chunks' global order."""
    pairs = []
    for a, query in enumerate(query_chunks):
        for b, key in enumerate(key_chunks):
            if query > key:
                pairs.append((a, b, False))
            elif query == key:
                pairs.append((a, b, True))
    return pairs


@dataclass
class AttentionWork:
    """Attention FLOPs this rank computed in forward (QKᵀ and PV over unmasked entries)."""

    flops: int = 0

    def add(self, q: torch.Tensor, causal: bool) -> None:
        batch, heads, length, head_dim = q.shape
        entries = length * (length + 1) // 2 if causal else length * length
        self.flops += 4 * batch * heads * head_dim * entries


@dataclass
class Ring:
    """One rank's place in a ring of `group.size` ranks and what it needs to run blocks."""

    comm: Comm
    group: Group
    kernels: Kernels
    # ring position -> the global chunk ids it holds, ascending
    chunks_of: Callable[[int], tuple[int, ...]]
    position: int  # this rank's index in `group`
    work: AttentionWork = field(default_factory=AttentionWork)

    @property
    def size(self) -> int:
        return self.group.size

    def next_rank(self) -> int:
        return self.group.ranks[(self.position + 1) % self.size]

    def previous_rank(self) -> int:
        return self.group.ranks[(self.position - 1) % self.size]

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, *, count: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if count:
            self.work.add(q, causal)
        kernel = self.kernels.get("attention", q.device, q.dtype)
        return kernel(q, k, v, causal, return_lse=True)

    def send_next(self, tensor: torch.Tensor) -> Any:
        return self.comm.send(
            tensor, dst=self.next_rank(), group=self.group, async_op=True, purpose=CP_KV
        )

    def recv_previous(
        self, like: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[Any, torch.Tensor]:
        buffer = torch.empty(like.shape, dtype=dtype or like.dtype, device=like.device)
        work = self.comm.recv(
            buffer, src=self.previous_rank(), group=self.group, async_op=True, purpose=CP_KV
        )
        return work, buffer


def merge(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block's (out, lse) into the running ones, in float32."""
    block_out = block_out.float()
    if out is None or lse is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    out = out * (lse - merged).exp().unsqueeze(-1) + block_out * (
        block_lse - merged
    ).exp().unsqueeze(-1)
    return out, merged


def ring_forward(
    ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output and log-sum-exp over the whole ring's keys."""
    query_chunks = ring.chunks_of(ring.position)
    n = len(query_chunks)
    queries = q.chunk(n, dim=2)
    outs: list[torch.Tensor | None] = [None] * n
    lses: list[torch.Tensor | None] = [None] * n
    kv = torch.stack([k, v]).contiguous()
    for step in range(ring.size):
        source = (ring.position - step) % ring.size
        transfer = None
        if step < ring.size - 1:
            transfer = ring.recv_previous(kv)
            sent = ring.send_next(kv)
        keys, values = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
        for a, b, causal in block_pairs(query_chunks, ring.chunks_of(source)):
            block_out, block_lse = ring.attention(
                queries[a], keys[b], values[b], causal, count=True
            )
            outs[a], lses[a] = merge(outs[a], lses[a], block_out, block_lse)
        if transfer is not None:
            transfer[0].wait()
            sent.wait()
            kv = transfer[1]
    # Every query chunk sees at least its own chunk, so every entry is set.
    out = torch.cat(outs, dim=2).to(q.dtype)  # type: ignore[arg-type]
    lse = torch.cat(lses, dim=2)  # type: ignore[arg-type]
    return out, lse


def ring_backward(
    ring: Ring,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    query_chunks = ring.chunks_of(ring.position)
    n = len(query_chunks)
    queries, lses = q.chunk(n, dim=2), lse.chunk(n, dim=2)
    douts = [d.float() for d in dout.chunk(n, dim=2)]
    # delta = rowsum(dO · O): the part of every block's score gradient the merge shares.
    deltas = [(d * o.float()).sum(-1) for d, o in zip(douts, out.chunk(n, dim=2), strict=True)]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dqs = dq.chunk(n, dim=2)
    kv = torch.stack([k, v]).contiguous()
    sends: list[tuple[Any, torch.Tensor]] = []
    for step in range(ring.size):
        source = (ring.position - step) % ring.size
        # Posting order matters: the previous rank sent this block's partial dK/dV at the end
        # of its last step, before the next K/V block; receives match sends in order.
        partial = ring.recv_previous(kv, torch.float32) if step > 0 else None
        transfer = None
        if step < ring.size - 1:
            transfer = ring.recv_previous(kv)
            sends.append((ring.send_next(kv), kv))
        local = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        keys, values = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
        dkeys, dvalues = local[0].chunk(n, dim=2), local[1].chunk(n, dim=2)
        for a, b, causal in block_pairs(query_chunks, ring.chunks_of(source)):
            with torch.enable_grad():
                qa = queries[a].detach().requires_grad_()
                kb = keys[b].detach().requires_grad_()
                vb = values[b].detach().requires_grad_()
                block_out, block_lse = ring.attention(qa, kb, vb, causal, count=False)
            weight = (block_lse.detach() - lses[a]).exp()
            grad_out = douts[a] * weight.unsqueeze(-1)
            grad_lse = weight * ((douts[a] * block_out.detach().float()).sum(-1) - deltas[a])
            gq, gk, gv = torch.autograd.grad(
                (block_out, block_lse), (qa, kb, vb), (grad_out.to(block_out.dtype), grad_lse)
            )
            dqs[a].add_(gq)
            dkeys[b].add_(gk)
            dvalues[b].add_(gv)
        if partial is not None:
            partial[0].wait()
            local += partial[1]
        sends.append((ring.send_next(local), local))
        if transfer is not None:
            transfer[0].wait()
            kv = transfer[1]
    final_work, final = ring.recv_previous(kv, torch.float32)
    final_work.wait()
    for work, _ in sends:
        work.wait()
    return dq.to(q.dtype), final[0].to(k.dtype), final[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys in `ring`."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring
    ) -> torch.Tensor:
        out, lse = ring_forward(ring, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.ring, q, k, v, out, lse, dout.contiguous())
        return dq, dk, dv, None


def ring_attention(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return RingAttention.apply(q, k, v, ring)
