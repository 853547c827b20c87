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

Packed rows (`plait.core.documents`): a query attends only to keys of its own document. Every
(query chunk, key chunk) pair then runs the kernel with the query chunk's document ids and the
key chunk's (`document_ids=` / `key_document_ids=`), causal on the diagonal as before. Ids never
decrease along a row, so two chunks share a document on a row only if their id ranges overlap:
`RingDocuments` reads that from each chunk's first and last ids, for every pair at once (one
device-to-host copy per micro-batch, not one per block), and the pairs sharing none are skipped.
The K/V blocks still travel the whole ring (every rank's schedule of sends and receives stays
the same, whatever the documents). A query may see no key of a block (lse −inf): the merge gives
such a block weight 0, and two −inf operands merge to −inf with output 0, never NaN.

The layout. Document masking removes the pairs across documents, and what is left depends on the
lengths: with documents much shorter than a chunk nearly all the work is on the diagonal blocks
and any layout is balanced; with one document per row it is plain causal attention, which the
zig-zag balances exactly. Measured with the ring's own `AttentionWork` and `block_pairs` on a
realistic mix, `python -m plait.tools.bench.cp_documents` (T = 4096, 32 rows, document lengths
log-normal with median T/4, σ = 1, 3.7 documents per row): the busiest ring position's work over
the mean, for one micro-batch of all 32 rows, for micro-batches of one row, and summed per ring
step (positions wait for each other's blocks at every step), one row:

    ring   zig-zag: 32 rows / 1 row / per step    contiguous: 32 rows / 1 row / per step
    2               1.03  /  1.21 /  1.27                     1.35  /  1.33 /  1.39
    4               1.04  /  1.38 /  1.71                     1.51  /  1.72 /  1.89
    8               1.06  /  1.50 /  1.98                     1.64  /  2.07 /  2.22

The zig-zag is the better of the two on every measure and stays: it is exact for rows of one
document, within 6 % of even once a micro-batch holds many rows, and its cut is the same for
every batch, so the engine cuts tensors and the model reads positions without knowing the
documents. Contiguous shards with gathered K/V would also lose the ring's overlap of transfer and
compute. What is left is the imbalance of a micro-batch of one long packed row (1.2–1.5×): a
per-document zig-zag (every document cut into 2·R chunks, each padded to a multiple of 2·R, which
costs 0.1–0.7 % padding on this mix) would remove it, at the price of a cut that changes per
batch and per row, which the engine's cut and the data pipeline's padding do not offer yet.

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
from plait.core.documents import document_mask
from plait.core.kernels import Kernels

BlockPair = tuple[int, int, bool]  # (local query chunk, local key chunk, causal)


@dataclass(frozen=True, slots=True, eq=False)
class RingDocuments:
    """The documents of a micro-batch's rows as the ring sees them: every global chunk's ids,
    and which (query chunk, key chunk) pairs share a document on some row."""

    chunk_ids: tuple[torch.Tensor, ...]  # global chunk -> (rows, chunk length) int32
    shared: tuple[tuple[bool, ...], ...]  # [query chunk][key chunk]

    @classmethod
    def of(cls, document_ids: torch.Tensor, num_chunks: int) -> RingDocuments:
        """From whole rows' ids (rows, seq), non-decreasing along each row."""
        rows, seq = document_ids.shape
        chunks = document_ids.view(rows, num_chunks, seq // num_chunks)
        first, last = chunks[:, :, 0], chunks[:, :, -1]  # (rows, chunks)
        # Sorted ids: chunks c and d hold a common id on a row iff their [first, last] ranges
        # overlap there.
        overlap = (first[:, :, None] <= last[:, None, :]) & (first[:, None, :] <= last[:, :, None])
        shared = tuple(tuple(row) for row in overlap.any(0).tolist())
        return cls(chunk_ids=tuple(chunks.unbind(1)), shared=shared)

    def ids(self, chunks: tuple[int, ...]) -> torch.Tensor:
        """The ids of `chunks` (global chunk ids, ascending) side by side: one ring position's
        portion of the rows."""
        return torch.cat([self.chunk_ids[c] for c in chunks], dim=1)


def block_pairs(
    query_chunks: tuple[int, ...],
    key_chunks: tuple[int, ...],
    documents: RingDocuments | None = None,
) -> list[BlockPair]:
    """The (query, key) chunk pairs causal attention needs, by the chunks' global order; with
    `documents`, only the pairs in which some query may see some key."""
    pairs = []
    for a, query in enumerate(query_chunks):
        for b, key in enumerate(key_chunks):
            if query < key or (documents is not None and not documents.shared[query][key]):
                continue
            pairs.append((a, b, query == key))
    return pairs


@dataclass
class AttentionWork:
    """Attention FLOPs this rank computed in forward (QKᵀ and PV over unmasked entries): with
    packed rows only the entries whose query and key share a document count, so the figure is
    the work a kernel that skips masked tiles does. Document-masked counts accumulate on the
    device and are read when `flops` is."""

    counted: int = 0
    pending: torch.Tensor | None = None
    blocks: int = 0  # (query chunk, key chunk) blocks computed
    skipped: int = 0  # blocks skipped because no query in them may see a key

    @property
    def flops(self) -> int:
        if self.pending is not None:
            self.counted += int(self.pending)
            self.pending = None
        return self.counted

    def add(
        self,
        q: torch.Tensor,
        causal: bool,
        query_ids: torch.Tensor | None = None,
        key_ids: torch.Tensor | None = None,
    ) -> None:
        batch, heads, length, head_dim = q.shape
        self.blocks += 1
        per_entry = 4 * heads * head_dim
        if query_ids is None or key_ids is None:
            entries = length * (length + 1) // 2 if causal else length * length
            self.counted += per_entry * batch * entries
            return
        allowed = document_mask(query_ids, key_ids, causal=causal).sum() * per_entry
        self.pending = allowed if self.pending is None else self.pending + allowed


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
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        *,
        count: bool,
        query_ids: torch.Tensor | None = None,
        key_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if count:
            self.work.add(q, causal, query_ids, key_ids)
        kernel = self.kernels.get("attention", q.device, q.dtype)
        if query_ids is None:
            return kernel(q, k, v, causal, return_lse=True)
        return kernel(
            q, k, v, causal, return_lse=True, document_ids=query_ids, key_document_ids=key_ids
        )

    def pairs(
        self, source: int, documents: RingDocuments | None, *, count: bool
    ) -> list[BlockPair]:
        """The blocks this rank computes with the K/V block of ring position `source`."""
        query_chunks, key_chunks = self.chunks_of(self.position), self.chunks_of(source)
        pairs = block_pairs(query_chunks, key_chunks, documents)
        if count and documents is not None:
            self.work.skipped += len(block_pairs(query_chunks, key_chunks)) - len(pairs)
        return pairs

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
    """Fold one block's (out, lse) into the running ones, in float32. A query that has seen no
    key on either side (both lse −inf, packed rows) keeps output 0 and lse −inf: its weights
    are exp(−inf − 0) = 0 rather than exp(−inf + inf) = NaN."""
    block_out = block_out.float()
    if out is None or lse is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    pivot = merged.masked_fill(merged == float("-inf"), 0.0)
    out = out * (lse - pivot).exp().unsqueeze(-1) + block_out * (block_lse - pivot).exp().unsqueeze(
        -1
    )
    return out, merged


def _ids(
    documents: RingDocuments | None, chunks: tuple[int, ...], local: int
) -> torch.Tensor | None:
    return None if documents is None else documents.chunk_ids[chunks[local]]


def ring_forward(
    ring: Ring,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: RingDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output and log-sum-exp over the whole ring's keys (inside each
    document, with `documents`)."""
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
        key_chunks = ring.chunks_of(source)
        for a, b, causal in ring.pairs(source, documents, count=True):
            block_out, block_lse = ring.attention(
                queries[a],
                keys[b],
                values[b],
                causal,
                count=True,
                query_ids=_ids(documents, query_chunks, a),
                key_ids=_ids(documents, key_chunks, b),
            )
            outs[a], lses[a] = merge(outs[a], lses[a], block_out, block_lse)
        if transfer is not None:
            transfer[0].wait()
            sent.wait()
            kv = transfer[1]
    # Every query chunk sees at least its own chunk (the diagonal always shares a document),
    # so every entry is set.
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
    documents: RingDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    query_chunks = ring.chunks_of(ring.position)
    n = len(query_chunks)
    # A query that saw no key at all (lse −inf) takes no gradient: every block's weight
    # exp(block lse − lse) is then exp(−inf − 0) = 0, not NaN.
    lse = lse.masked_fill(lse == float("-inf"), 0.0)
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
        key_chunks = ring.chunks_of(source)
        for a, b, causal in ring.pairs(source, documents, count=False):
            with torch.enable_grad():
                qa = queries[a].detach().requires_grad_()
                kb = keys[b].detach().requires_grad_()
                vb = values[b].detach().requires_grad_()
                block_out, block_lse = ring.attention(
                    qa,
                    kb,
                    vb,
                    causal,
                    count=False,
                    query_ids=_ids(documents, query_chunks, a),
                    key_ids=_ids(documents, key_chunks, b),
                )
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
    """Causal attention of this rank's queries over every rank's keys in `ring`, inside each
    document when `documents` is given."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: Ring,
        documents: RingDocuments | None,
    ) -> torch.Tensor:
        out, lse = ring_forward(ring, q, k, v, documents)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.documents = ring, documents
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.ring, q, k, v, out, lse, dout.contiguous(), ctx.documents)
        return dq, dk, dv, None, None


def ring_attention(
    ring: Ring,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: RingDocuments | None = None,
) -> torch.Tensor:
    return RingAttention.apply(q, k, v, ring, documents)
