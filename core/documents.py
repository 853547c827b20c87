"""The document structure of packed rows: one typed record, computed on whole rows, read by all.

A packed row holds several documents end to end. Attention must not cross a boundary, positions
restart at every document, and the FLOPs of attention are each document's own. `Documents` is
that structure for one micro-batch, computed before anything cuts the row (context parallelism
keeps only some positions of every row; a shard never infers boundaries from its own piece):

    documents = Documents.from_positions(position_ids)   # (rows, seq), restarting at 0
    attention(q, k, v, causal=True, document_ids=documents.document_ids)
    documents.lengths()            # every document's token count, row by row
    documents.attention_pairs()    # Σ nᵢ(nᵢ+1)/2: the (query, key) pairs causal attention scores

A document starts wherever a position is 0 (the convention of transformers'
`DataCollatorWithFlattening` and of plait's packed sampler), or where varlen metadata says
(`cu_seq_lens_q`, as flash-attention kwargs carry it). Document ids count across the whole
micro-batch, so ids of different rows never meet and one id names one document; within a row
they never decrease, which lets a kernel skip the tiles where no query may see a key.
Megatron-Core's `PackedSeqParams` is the same idea for its THD format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from plait.core.errors import PlaitError

# Keys under which a batch carries restarting positions: plait's models take `positions`,
# transformers' models `position_ids`.
POSITION_KEYS = ("positions", "position_ids")


@dataclass(frozen=True, slots=True, eq=False)
class Documents:
    """Documents of a micro-batch's packed rows (rows, seq), computed on whole rows."""

    document_ids: torch.Tensor  # (rows, seq) int32, non-decreasing per row, unique per batch
    positions: torch.Tensor  # (rows, seq) int64: each token's position in its document
    cu_seqlens: torch.Tensor  # (documents + 1,) int32: starts in the flattened rows·seq tokens
    max_seqlen: int  # the longest document, in tokens

    @classmethod
    def from_positions(cls, positions: torch.Tensor) -> Documents:
        """Documents from position ids that restart at 0 at every document start."""
        if positions.ndim == 1:
            positions = positions.unsqueeze(0)
        if positions.ndim != 2 or positions.is_floating_point():
            raise PlaitError(
                f"position ids must be an integer tensor (rows, seq); got {positions.dtype} of "
                f"shape {tuple(positions.shape)}"
            )
        starts = positions == 0
        # A row's first token always starts a document, whatever its position says (a row cut
        # from the middle of a document continues it as a document of its own).
        starts[:, 0] = True
        broken = (~starts[:, 1:]) & (positions[:, 1:] != positions[:, :-1] + 1)
        if bool(broken.any()):
            row, column = (int(i) for i in broken.nonzero()[0])
            raise PlaitError(
                f"position ids of a packed row must count up by one inside a document and "
                f"restart at 0 at the next; row {row} goes from {int(positions[row, column])} "
                f"to {int(positions[row, column + 1])} at column {column + 1}"
            )
        return cls._from_starts(starts, positions.long())

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, seq_len: int, rows: int = 1) -> Documents:
        """Documents from varlen offsets over the flattened `rows · seq_len` tokens."""
        offsets = cu_seqlens.long()
        total = rows * seq_len
        if offsets.ndim != 1 or offsets.numel() < 2 or int(offsets[0]) != 0:
            raise PlaitError(f"cu_seqlens must be 1-D and start at 0; got {offsets.tolist()}")
        if bool((offsets[1:] <= offsets[:-1]).any()) or int(offsets[-1]) != total:
            raise PlaitError(
                f"cu_seqlens must increase strictly up to rows·seq = {total}; got "
                f"{offsets.tolist()}"
            )
        starts = torch.zeros(total, dtype=torch.bool, device=offsets.device)
        starts[offsets[:-1]] = True
        starts = starts.view(rows, seq_len)
        starts[:, 0] = True
        return cls._from_starts(starts, None)

    @classmethod
    def _from_starts(cls, starts: torch.Tensor, positions: torch.Tensor | None) -> Documents:
        rows, seq = starts.shape
        flat_starts = starts.reshape(-1)
        document_ids = (torch.cumsum(flat_starts.int(), 0) - 1).to(torch.int32)
        start_index = flat_starts.nonzero().squeeze(1)
        total = rows * seq
        cu_seqlens = torch.cat([start_index, torch.tensor([total], device=starts.device)]).to(
            torch.int32
        )
        if positions is None:
            index = torch.arange(total, device=starts.device)
            positions = (index - start_index[document_ids.long()]).view(rows, seq)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        return cls(
            document_ids=document_ids.view(rows, seq),
            positions=positions,
            cu_seqlens=cu_seqlens,
            max_seqlen=int(lengths.max()),
        )

    @property
    def rows(self) -> int:
        return self.document_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.document_ids.shape[1]

    @property
    def count(self) -> int:
        """Documents in the micro-batch (pieces of a document cut by a row end count apart)."""
        return self.cu_seqlens.numel() - 1

    def lengths(self) -> torch.Tensor:
        """Every document's token count, in order (row by row)."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    def attention_pairs(self) -> int:
        """(query, key) pairs that causal document-masked attention scores: Σ nᵢ(nᵢ+1)/2."""
        lengths = self.lengths()
        return int((lengths * (lengths + 1) // 2).sum())

    def ids_at(self, global_positions: torch.Tensor) -> torch.Tensor:
        """The document ids of the tokens at `global_positions` of every row (a shard's)."""
        return self.document_ids.index_select(1, global_positions.to(self.document_ids.device))

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Documents:
        return Documents(
            document_ids=self.document_ids.to(device, non_blocking=non_blocking),
            positions=self.positions.to(device, non_blocking=non_blocking),
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=non_blocking),
            max_seqlen=self.max_seqlen,
        )

    def __repr__(self) -> str:
        return f"Documents(rows={self.rows}, seq_len={self.seq_len}, count={self.count})"


def restarting_positions(inputs: Any) -> torch.Tensor | None:
    """The position ids a dict batch carries under `positions` / `position_ids`, when they are
    (rows, seq) and restart somewhere (a packed batch); `None` for plain rows 0 … seq − 1."""
    if not isinstance(inputs, Mapping):
        return None
    for key in POSITION_KEYS:
        positions = inputs.get(key)
        if isinstance(positions, torch.Tensor) and positions.ndim == 2:
            expected = torch.arange(positions.shape[1], device=positions.device)
            if not bool((positions == expected).all()):
                return positions
    return None


def documents_of(inputs: Any) -> Documents | None:
    """The document structure of a micro-batch's inputs, or `None` when its rows are each one
    sequence: restarting position ids, or transformers' varlen `cu_seq_lens_q` (one row)."""
    positions = restarting_positions(inputs)
    if positions is not None:
        return Documents.from_positions(positions)
    if isinstance(inputs, Mapping) and isinstance(inputs.get("cu_seq_lens_q"), torch.Tensor):
        tokens = inputs.get("input_ids")
        if not isinstance(tokens, torch.Tensor):
            raise PlaitError("a batch with cu_seq_lens_q must carry input_ids (1, total)")
        return Documents.from_cu_seqlens(inputs["cu_seq_lens_q"], tokens.shape[-1], rows=1)
    return None


def document_mask(
    query_ids: torch.Tensor,
    key_ids: torch.Tensor,
    *,
    causal: bool,
) -> torch.Tensor:
    """(rows, 1, q, k) boolean: which keys each query may attend to. Same document, and with
    `causal` not after the query (bottom-right aligned, as FlashAttention)."""
    allowed = query_ids[:, None, :, None] == key_ids[:, None, None, :]
    if causal:
        q_len, k_len = query_ids.shape[-1], key_ids.shape[-1]
        later = torch.ones(q_len, k_len, dtype=torch.bool, device=query_ids.device).triu(
            1 + k_len - q_len
        )
        allowed = allowed & ~later
    return allowed
