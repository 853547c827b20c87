"""The attention a context-parallel model runs: Ulysses all-to-all, ring, or both (hybrid).

`ContextParallelAttention` is what the strategy installs as each attention module's
`attend(q, k, v, documents=None)`: q/k/v hold this rank's positions of every sequence, all local
heads. With a Ulysses group, heads are exchanged for positions first (the group's positions are
then one ring position's chunks, in order); with a ring of more than one position, blocks go
round it; otherwise the positions are the whole sequence and plain causal attention from the
kernel facade does.

Packed rows: `documents` (`plait.core.documents.Documents`) is the structure of the whole rows,
computed before the micro-batch was cut, so every rank knows every position's document. After
the all-to-all a rank holds its ring position's portion whole (for some heads) and attends with
the ids at those positions; the ring gives each (query chunk, key chunk) block the ids of both
(`ring.RingDocuments`, computed once per micro-batch and reused by every layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plait.core.documents import Documents
from plait.core.kernels import Kernels
from plait.core.transforms import ContextParallelism
from plait.plugins.context_parallel.ring import Ring, RingDocuments, ring_attention
from plait.plugins.context_parallel.ulysses import (
    HeadExchange,
    check_heads,
    heads_to_sequence,
    kv_repeats,
    sequence_to_heads,
)

# The whole attention call runs eagerly under `torch.compile`: a compiled block breaks its graph
# there (Dynamo counts the break) instead of tracing the communicator, whose per-group sequence
# numbers would be guarded on and recompile the block at every step. The call, not just its
# exchange (measured, `plait.plugins.compile`): the ring's send/receive sit inside one autograd
# function, eager as a whole, which breaks more often than the call does, and Ulysses'
# all-to-alls cut the block into a graph more.
eager_under_compile = torch.compiler.disable


@dataclass(frozen=True, slots=True)
class ContextParallelAttention:
    kernels: Kernels
    ring: Ring | None = None  # None: a ring of one position
    exchange: HeadExchange | None = None  # None: no Ulysses all-to-all
    # Which positions each ring position holds (needed for packed rows); None: this rank's
    # positions are the whole sequence.
    layout: ContextParallelism | None = None
    # The last micro-batch's documents and their ring view: every layer of a forward (and the
    # recomputation in backward) is handed the same `Documents` object.
    _last: list[tuple[Documents, RingDocuments]] = field(default_factory=list, repr=False)

    @eager_under_compile
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        if self.exchange is not None:
            degree = self.exchange.size
            heads, kv_heads = q.shape[1], k.shape[1]
            check_heads(heads, kv_heads, degree, where="context parallel attention")
            repeats = kv_repeats(heads, kv_heads, degree)
            if repeats > 1:
                k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            q, k, v = (sequence_to_heads(t, self.exchange) for t in (q, k, v))
        chunks = self._ring_documents(documents, q.device) if documents is not None else None
        if self.ring is not None:
            out = ring_attention(self.ring, q, k, v, chunks)
        else:
            kernel = self.kernels.get("attention", q.device, q.dtype)
            if chunks is None:
                out = kernel(q, k, v, causal=True)
            else:
                out = kernel(q, k, v, causal=True, document_ids=self._portion_ids(chunks))
        if self.exchange is not None:
            out = heads_to_sequence(out, self.exchange)
        return out

    def _ring_documents(self, documents: Documents, device: torch.device) -> RingDocuments:
        if self._last and self._last[0][0] is documents:
            return self._last[0][1]
        chunks = self.layout.num_chunks if self.layout is not None else 1
        ids = documents.document_ids.to(device)
        if ids.shape[1] % chunks:
            raise ValueError(
                f"context parallel attention: rows of {ids.shape[1]} tokens do not divide into "
                f"{chunks} chunks"
            )
        ring_documents = RingDocuments.of(ids, chunks)
        self._last[:] = [(documents, ring_documents)]
        return ring_documents

    def _portion_ids(self, chunks: RingDocuments) -> torch.Tensor:
        """The ids of the positions this rank holds once Ulysses has run: its ring position's
        portion (the whole row when there is no ring)."""
        if self.layout is None:
            return chunks.ids(tuple(range(len(chunks.chunk_ids))))
        return chunks.ids(self.layout.ring_chunks(self.layout.ring_rank))
