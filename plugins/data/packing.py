"""Packing: documents laid into rows of `seq_len` tokens, and the rows turned into arrays.

A `RowPlan` says which pieces of which documents fill each row, left to right from column 0,
the rest of the row being padding. Three planners, all vectorised with numpy:

- `plan_concat_split`: the documents end to end in the given order, cut every `seq_len`
  tokens; a document crossing a row's end continues at the start of the next row as a new
  piece. Only the last row has padding.
- `plan_first_fit`: pieces of at most `seq_len` tokens bin-packed first-fit-decreasing, one
  row per bin, each padded.
- `plan_one_per_row`: one piece per row, padded.

A document longer than a row is cut into pieces of `seq_len` tokens (concat_split cuts where
rows end); a piece counts as a document of its own.

`fill_rows` writes the arrays a model trains on, for some rows of a plan:

- `tokens`: the pieces' tokens, then `pad_id`;
- `positions`: 0, 1, 2, … restarting at every piece, and once more at the padding (one padding
  "document"), so a position of 0 is where a document starts (transformers' `position_ids`
  convention, read by `plait.core.documents`); with `document_mask=False`, 0 … seq_len-1;
- `targets`: each token's next token inside its piece; the piece's last token and every
  padding token have `IGNORE_INDEX` (-100). So no token is trained to predict another
  document's first token, and since every prepared document ends with EOS, the token before EOS
  is trained to predict EOS while EOS itself predicts nothing. A piece of n tokens scores n - 1.
  With a `loss_mask` (one 0/1 per token of the directory, `loss_mask_file.py`), a target whose
  token is not trained is `IGNORE_INDEX` too: only the masked-in tokens are predicted. The mask
  is read in the same gather as the tokens, so every packing (and document_mask off) honours it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True, eq=False)
class RowPlan:
    """Pieces of documents in rows of `seq_len` tokens, as compressed rows (CSR): the pieces of
    row r are `[row_starts[r], row_starts[r + 1])`, in column order from column 0."""

    seq_len: int
    row_starts: np.ndarray  # (rows + 1,) int64
    token_starts: np.ndarray  # (pieces,) int64: the piece's first token in tokens.bin
    lengths: np.ndarray  # (pieces,) int64, each in [1, seq_len]

    @property
    def rows(self) -> int:
        return int(self.row_starts.size - 1)

    @property
    def pieces(self) -> int:
        return int(self.lengths.size)

    @property
    def padding_tokens(self) -> int:
        return self.rows * self.seq_len - int(self.lengths.sum())

    @property
    def padding_fraction(self) -> float:
        return self.padding_tokens / max(1, self.rows * self.seq_len)

    def take_rows(self, rows: np.ndarray) -> RowPlan:
        """The plan of `rows` of this one, in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        first = self.row_starts[rows]
        counts = self.row_starts[rows + 1] - first
        pieces = _ranges(first, counts)
        row_starts = np.zeros(rows.size + 1, dtype=np.int64)
        np.cumsum(counts, out=row_starts[1:])
        return RowPlan(
            seq_len=self.seq_len,
            row_starts=row_starts,
            token_starts=self.token_starts[pieces],
            lengths=self.lengths[pieces],
        )


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`, vectorised."""
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + (np.arange(total, dtype=np.int64) - offsets)


def cut_pieces(
    starts: np.ndarray, lengths: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Documents cut into pieces of at most `seq_len` tokens: `(piece starts, piece lengths)`,
    the pieces of each document in order, documents in the given order."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = -(-lengths // seq_len)
    index_in_document = _ranges(np.zeros_like(counts), counts)
    document = np.repeat(np.arange(lengths.size), counts)
    piece_starts = starts[document] + index_in_document * seq_len
    piece_lengths = np.minimum(seq_len, lengths[document] - index_in_document * seq_len)
    return piece_starts, piece_lengths


def plan_concat_split(starts: np.ndarray, lengths: np.ndarray, seq_len: int) -> RowPlan:
    """Documents (in the order given) end to end, cut into rows of `seq_len` tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    stream_starts = ends - lengths
    # A piece begins wherever a document or a row begins. (Sorted and deduplicated by hand:
    # np.union1d is ~30× slower on a million documents.)
    cuts = np.concatenate((stream_starts, np.arange(0, total, seq_len, dtype=np.int64)))
    cuts.sort()
    cuts = cuts[np.concatenate(([True], cuts[1:] != cuts[:-1]))]
    piece_lengths = np.diff(cuts, append=np.int64(total))
    document = np.searchsorted(ends, cuts, side="right")
    token_starts = starts[document] + (cuts - stream_starts[document])
    rows = -(-total // seq_len)
    row_starts = np.searchsorted(cuts, np.arange(rows + 1, dtype=np.int64) * seq_len)
    return RowPlan(
        seq_len=seq_len,
        row_starts=row_starts.astype(np.int64),
        token_starts=token_starts,
        lengths=piece_lengths,
    )


def plan_one_per_row(starts: np.ndarray, lengths: np.ndarray, seq_len: int) -> RowPlan:
    """One piece per row, documents in the order given."""
    token_starts, piece_lengths = cut_pieces(starts, lengths, seq_len)
    return RowPlan(
        seq_len=seq_len,
        row_starts=np.arange(piece_lengths.size + 1, dtype=np.int64),
        token_starts=token_starts,
        lengths=piece_lengths,
    )


def plan_first_fit(starts: np.ndarray, lengths: np.ndarray, seq_len: int) -> RowPlan:
    """First-fit-decreasing: pieces from longest to shortest (equal lengths in the order
    given), each into the first row with room for it, else a new row.

    Pieces of one length are placed together: first fit sends a run of equal pieces to the
    first row with room until it is full, then to the next, so a run is one cumulative sum
    over the rows with room, and the cost is O(distinct lengths × rows) in numpy rather than a
    Python step per document.
    """
    token_starts, piece_lengths = cut_pieces(starts, lengths, seq_len)
    order = np.argsort(-piece_lengths, kind="stable")
    sorted_lengths = piece_lengths[order]
    row_of = np.empty(order.size, dtype=np.int64)  # by position in `order`
    room = np.empty(order.size, dtype=np.int64)  # free tokens of each row opened so far
    rows = 0
    run_starts = np.flatnonzero(np.diff(sorted_lengths, prepend=np.int64(seq_len + 1)))
    run_ends = np.append(run_starts[1:], order.size)
    for first, end in zip(run_starts.tolist(), run_ends.tolist(), strict=True):
        length = int(sorted_lengths[first])
        count = end - first
        fitting = np.flatnonzero(room[:rows] >= length)
        placed = 0
        if fitting.size:
            capacity = room[fitting] // length
            filled = np.cumsum(capacity)
            used = min(int(np.searchsorted(filled, count)) + 1, fitting.size)
            taken = capacity[:used].copy()
            taken[-1] -= max(0, int(filled[used - 1]) - count)
            placed = int(taken.sum())
            row_of[first : first + placed] = np.repeat(fitting[:used], taken)
            room[fitting[:used]] -= taken * length
        left = count - placed
        if left:
            per_row = seq_len // length
            new_rows = -(-left // per_row)
            taken = np.full(new_rows, per_row, dtype=np.int64)
            taken[-1] = left - per_row * (new_rows - 1)
            new = np.arange(rows, rows + new_rows, dtype=np.int64)
            row_of[first + placed : end] = np.repeat(new, taken)
            room[new] = seq_len - taken * length
            rows += new_rows
    # Pieces by row, in the order they were placed (longest first).
    by_row = np.argsort(row_of, kind="stable")
    pieces = order[by_row]
    row_starts = np.searchsorted(row_of[by_row], np.arange(rows + 1, dtype=np.int64))
    return RowPlan(
        seq_len=seq_len,
        row_starts=row_starts.astype(np.int64),
        token_starts=token_starts[pieces],
        lengths=piece_lengths[pieces],
    )


PLANNERS = {
    "concat_split": plan_concat_split,
    "first_fit": plan_first_fit,
    "none": plan_one_per_row,
}


def fill_rows(
    plan: RowPlan,
    tokens: np.ndarray,
    *,
    pad_id: int,
    document_mask: bool = True,
    loss_mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(tokens, positions, targets)`, int64 arrays of shape (plan.rows, seq_len), for every
    row of `plan` (take the rows of a batch with `RowPlan.take_rows` first). `loss_mask`, aligned
    with `tokens`, leaves untrained tokens out of the targets."""
    rows, seq_len = plan.rows, plan.seq_len
    lengths = plan.lengths
    pieces_per_row = np.diff(plan.row_starts)
    # Pieces are stored row after row, so a row's first token is a prefix sum at its first piece.
    tokens_before = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    row_first_token = tokens_before[plan.row_starts]
    row_of_piece = np.repeat(np.arange(rows, dtype=np.int64), pieces_per_row)
    columns = tokens_before[:-1] - row_first_token[row_of_piece]
    filled = np.diff(row_first_token)  # tokens (not padding) of each row

    within = _ranges(np.zeros_like(lengths), lengths)  # each token's position in its piece
    destination = np.repeat(row_of_piece * seq_len + columns, lengths) + within
    sources = _ranges(plan.token_starts, lengths)
    gathered = np.asarray(tokens[sources], dtype=np.int64)
    last_of_piece = within == np.repeat(lengths - 1, lengths)
    next_tokens = np.empty_like(gathered)
    next_tokens[:-1] = gathered[1:]
    if loss_mask is not None:
        # A target is the next token, so it is scored when the next token is trained.
        untrained = np.asarray(loss_mask[sources]) == 0
        next_tokens[:-1][untrained[1:]] = IGNORE_INDEX
    next_tokens[last_of_piece] = IGNORE_INDEX  # also the final token, whose slot is unset

    out_tokens = np.full(rows * seq_len, pad_id, dtype=np.int64)
    out_targets = np.full(rows * seq_len, IGNORE_INDEX, dtype=np.int64)
    out_tokens[destination] = gathered
    out_targets[destination] = next_tokens
    cols = np.arange(seq_len, dtype=np.int64)
    if document_mask:
        # Padding counts up from 0 as one more document; content positions overwrite the rest.
        out_positions = (cols[None, :] - filled[:, None]).reshape(-1)
        out_positions[destination] = within
    else:
        out_positions = np.broadcast_to(cols, (rows, seq_len)).reshape(-1).copy()
    shape = (rows, seq_len)
    return out_tokens.reshape(shape), out_positions.reshape(shape), out_targets.reshape(shape)
