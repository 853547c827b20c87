"""The varlen side of Triton attention: which tiles each program walks, from document ids.

Packed rows hold documents end to end, so along a row the document ids never decrease. The
queries of one block then belong to the documents from its first id to its last, and the keys
of those documents are one contiguous range of positions: `document_ranges` finds it for every
block with one binary search (`torch.searchsorted`, on the device, nothing read back), and the
kernels in `attention.py` walk only that range, as FlashAttention's varlen kernels walk only a
document's own keys. The same search with the roles swapped gives each key block the queries
that may see it (the dK/dV walk).

`cu_seqlens` (FlashAttention's and `plait.core.documents.Documents`' varlen offsets over the
flattened rows) become document ids with `ids_from_cu_seqlens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DocumentIds:
    """The document of every query and every key, validated, as the kernels read them."""

    queries: torch.Tensor  # (batch, seq_q), contiguous
    keys: torch.Tensor  # (batch, seq_k), contiguous, of the queries' dtype
    in_order: torch.Tensor  # (batch,) bool: both rows' ids never decrease

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        document_ids: torch.Tensor,
        key_document_ids: torch.Tensor | None,
    ) -> DocumentIds:
        keys = document_ids if key_document_ids is None else key_document_ids
        for name, ids, of in (("document_ids", document_ids, q), ("key_document_ids", keys, k)):
            expected = (of.shape[0], of.shape[2])
            if (
                tuple(ids.shape) != expected
                or ids.is_floating_point()
                or ids.is_complex()
                or ids.dtype == torch.bool
            ):
                raise ValueError(
                    f"attention: {name} must be an integer tensor (batch, seq) = {expected}; "
                    f"got {ids.dtype} of shape {tuple(ids.shape)}"
                )
            if ids.device != of.device:
                raise ValueError(f"attention: {name} is on {ids.device}, the inputs on {of.device}")
        dtype = torch.promote_types(document_ids.dtype, keys.dtype)  # searchsorted wants one
        queries = document_ids.to(dtype).contiguous()
        keys = keys.to(dtype).contiguous()
        in_order = _non_decreasing(queries) & _non_decreasing(keys)
        return cls(queries, keys, in_order)


def _non_decreasing(ids: torch.Tensor) -> torch.Tensor:
    return (ids[:, 1:] >= ids[:, :-1]).all(dim=1)


def document_ranges(
    block_ids: torch.Tensor, other_ids: torch.Tensor, block: int, in_order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For every block of `block` positions of `block_ids` (batch, n), the positions [lo, hi) of
    `other_ids` (batch, m) whose document lies between the block's first and last: the only
    keys a query block may see (or, roles swapped, the only queries that see a key block).

    Ids never decrease along a row, so a block's documents run from its first id to its last
    and the other side's positions of those documents are one contiguous range, found by a
    binary search per block (as FlashAttention's varlen kernels walk only a document's own
    keys). Nothing is read back to the host. A row whose ids are out of order gets the whole
    range: the kernels' element mask keeps it exact, only slower.
    """
    seq = block_ids.shape[1]
    starts = torch.arange(0, seq, block, device=block_ids.device)
    ends = (starts + block).clamp(max=seq) - 1
    lo = torch.searchsorted(other_ids, block_ids[:, starts].contiguous(), out_int32=True)
    hi = torch.searchsorted(other_ids, block_ids[:, ends].contiguous(), right=True, out_int32=True)
    lo = torch.where(in_order[:, None], lo, 0)
    hi = torch.where(in_order[:, None], hi, other_ids.shape[1])
    return lo.contiguous(), hi.contiguous()


class BlockRanges:
    """`document_ranges` of one call, computed once per block size (a tuned launch tries
    several) and shared by the forward and the backward."""

    def __init__(self, documents: DocumentIds | None) -> None:
        self.documents = documents
        self._memo: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def pointers(self, side: str, block: int) -> tuple[torch.Tensor | None, ...]:
        """(query ids, key ids, lo, hi) for the kernels, or Nones without documents. `side` is
        "keys" (the key range of each query block) or "queries" (of each key block)."""
        documents = self.documents
        if documents is None:
            return None, None, None, None
        memo = (side, block)
        if memo not in self._memo:
            blocks, other = (
                (documents.queries, documents.keys)
                if side == "keys"
                else (documents.keys, documents.queries)
            )
            self._memo[memo] = document_ranges(blocks, other, block, documents.in_order)
        return documents.queries, documents.keys, *self._memo[memo]


def document_ids_of(
    q: torch.Tensor,
    k: torch.Tensor,
    document_ids: torch.Tensor | None,
    key_document_ids: torch.Tensor | None,
) -> DocumentIds | None:
    if document_ids is None:
        if key_document_ids is not None:
            raise ValueError("attention: key_document_ids given without document_ids")
        return None
    return DocumentIds.of(q, k, document_ids, key_document_ids)


def ids_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """(batch, seq_len) int32 document ids from varlen offsets over the flattened batch·seq_len
    tokens (documents + 1 starts, from 0 to batch·seq_len). A document that runs over a row's
    end is cut there, as attention never crosses rows anyway."""
    positions = torch.arange(batch * seq_len, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    ids = torch.searchsorted(cu_seqlens, positions, right=True, out_int32=True) - 1
    return ids.view(batch, seq_len)
