"""Packing documents into rows, checked exhaustively on random mixes of document lengths, and the
packed sampler's contract: deterministic, dp slices of one global batch, resumable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from plait.core.config import DataSection
from plait.plugins.data import DataError, PackedBatches, TokenBatches, TokenFile, build_batches
from plait.plugins.data.documents_file import starts_from_lengths
from plait.plugins.data.packing import (
    IGNORE_INDEX,
    PLANNERS,
    RowPlan,
    fill_rows,
    plan_first_fit,
)
from plait.plugins.data.token_files import TokenDirectoryWriter
from plait.plugins.data.tokenizer import token_dtype

PRIMES = (3, 5, 7, 11, 13, 17, 19, 23, 29, 31)


def write_documents(directory: Path, lengths: list[int] | np.ndarray) -> TokenFile:
    """A token directory whose tokens are 1, 2, 3, … (0 is never a token, so padding shows) and
    whose documents have `lengths`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    vocab = total + 1
    with TokenDirectoryWriter(directory, dtype=token_dtype(vocab), documents=True) as writer:
        writer.write(
            np.arange(1, total + 1, dtype=np.int64), document_starts=starts_from_lengths(lengths)
        )
        writer.commit(vocab_size=vocab, tokenizer="counting", sources=())
    return TokenFile(directory, verify_checksum=True)


def length_mix(rng: np.random.Generator, seq_len: int, count: int) -> np.ndarray:
    """Lengths 1, 2, primes, exactly a row, a row ± 1, several rows, and random ones."""
    special = [1, 2, *PRIMES, seq_len, seq_len + 1, max(1, seq_len - 1), 2 * seq_len + 3]
    pool = np.array(special + list(rng.integers(1, 3 * seq_len + 2, size=len(special))))
    return rng.choice(pool, size=count)


def check_rows(
    tokens: np.ndarray,
    positions: np.ndarray,
    targets: np.ndarray,
    document_of: np.ndarray,
    document_start: np.ndarray,
    *,
    seq_len: int,
    packing: str,
) -> list[list[int]]:
    """Assert every invariant of packed rows; return each row's pieces as lists of tokens.

    `document_of[t]` is the document of token t, `document_start[t]` whether t begins one.
    """
    pieces: list[list[int]] = []
    for row in range(tokens.shape[0]):
        content = tokens[row] != 0
        filled = int(content.sum())
        assert content[:filled].all(), f"row {row}: padding before content"
        # Padding: one more "document", positions counting from 0, nothing scored.
        assert (positions[row, filled:] == np.arange(seq_len - filled)).all()
        assert (targets[row, filled:] == IGNORE_INDEX).all()
        piece: list[int] = []
        for column in range(filled):
            token = int(tokens[row, column])
            continues = (
                bool(piece)
                and token == piece[-1] + 1
                and not document_start[token]
                and document_of[token] == document_of[piece[-1]]
            )
            if not continues:
                if piece:
                    pieces.append(piece)
                piece = []
                # A piece starts a document, or is a row-sized cut of one; concat_split also
                # continues a document at the start of the next row.
                first = int(np.flatnonzero(document_of == document_of[token])[0])
                cut_at_row_size = (token - first) % seq_len == 0
                assert document_start[token] or (
                    column == 0 if packing == "concat_split" else cut_at_row_size
                ), f"row {row} column {column}: a piece starts inside a document"
            piece.append(token)
            assert positions[row, column] == len(piece) - 1, (
                f"row {row} column {column}: position {positions[row, column]}, expected "
                f"{len(piece) - 1} (positions restart exactly where a document starts)"
            )
            # The target is the next token of the same piece, else nothing.
            next_in_piece = (
                column + 1 < filled
                and int(tokens[row, column + 1]) == token + 1
                and not document_start[token + 1]
            )
            expected = token + 1 if next_in_piece else IGNORE_INDEX
            assert targets[row, column] == expected, (
                f"row {row} column {column}: target {targets[row, column]}, expected {expected}"
            )
        if piece:
            pieces.append(piece)
    return pieces


def document_tables(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    total = int(lengths.sum())
    document_of = np.full(total + 2, -1, dtype=np.int64)  # token 0 (padding) and past the end
    document_of[1 : total + 1] = np.repeat(np.arange(lengths.size), lengths)
    document_start = np.zeros(total + 2, dtype=bool)
    document_start[starts_from_lengths(lengths) + 1] = True
    document_start[total + 1] = True  # past the last token
    return document_of, document_start


@pytest.mark.parametrize("packing", sorted(PLANNERS))
@pytest.mark.parametrize("seq_len", [1, 2, 7, 16])
def test_every_document_appears_once_in_order_with_restarting_positions(
    packing: str, seq_len: int
) -> None:
    rng = np.random.default_rng(seq_len)
    for trial in range(8):
        lengths = length_mix(rng, seq_len, count=int(rng.integers(1, 40)))
        if trial == 0:
            lengths = np.array([seq_len])  # one document filling exactly one row
        starts = starts_from_lengths(lengths)
        order = rng.permutation(lengths.size)
        plan = PLANNERS[packing](starts[order], lengths[order], seq_len)
        tokens_file = np.arange(1, int(lengths.sum()) + 1)
        tokens, positions, targets = fill_rows(plan, tokens_file, pad_id=0)
        assert tokens.shape == (plan.rows, seq_len)
        document_of, document_start = document_tables(lengths)
        pieces = check_rows(
            tokens,
            positions,
            targets,
            document_of,
            document_start,
            seq_len=seq_len,
            packing=packing,
        )
        # Every token exactly once; each document's pieces, in row order, give it in order
        # (first_fit places a long document's pieces in any rows: sorted by first token).
        everything = np.concatenate([np.array(p) for p in pieces])
        assert np.array_equal(np.sort(everything), tokens_file)
        if packing == "concat_split":
            assert np.array_equal(
                everything,
                np.concatenate(
                    [
                        tokens_file[s : s + n]
                        for s, n in zip(starts[order], lengths[order], strict=True)
                    ]
                ),
            )
            assert plan.padding_tokens == plan.rows * seq_len - lengths.sum() < seq_len
        if packing == "none":
            assert plan.rows == sum(-(-n // seq_len) for n in lengths)
        assert all(len(p) <= seq_len for p in pieces)
        assert plan.padding_tokens == int((tokens == 0).sum())


def reference_first_fit(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """First-fit-decreasing one piece at a time, as a textbook writes it: pieces' indices by bin."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep order
    room: list[int] = []
    bins: list[list[int]] = []
    for i in order:
        for b, free in enumerate(room):
            if free >= lengths[i]:
                room[b] -= lengths[i]
                bins[b].append(i)
                break
        else:
            room.append(seq_len - lengths[i])
            bins.append([i])
    return bins


@pytest.mark.parametrize("seq_len", [2, 8, 13, 64])
def test_first_fit_is_first_fit_decreasing(seq_len: int) -> None:
    rng = np.random.default_rng(100 + seq_len)
    for _ in range(20):
        lengths = np.minimum(length_mix(rng, seq_len, count=int(rng.integers(1, 80))), seq_len)
        starts = starts_from_lengths(lengths)
        plan = plan_first_fit(starts, lengths, seq_len)
        index_of_start = {int(s): i for i, s in enumerate(starts)}
        rows = [
            [index_of_start[int(s)] for s in plan.token_starts[a:b]]
            for a, b in zip(plan.row_starts[:-1], plan.row_starts[1:], strict=True)
        ]
        assert rows == reference_first_fit(lengths, seq_len)


def test_document_mask_off_gives_plain_positions_and_the_same_targets() -> None:
    lengths = np.array([3, 5, 2, 9])
    plan = PLANNERS["concat_split"](starts_from_lengths(lengths), lengths, 8)
    tokens_file = np.arange(1, 20)
    masked = fill_rows(plan, tokens_file, pad_id=0)
    plain = fill_rows(plan, tokens_file, pad_id=0, document_mask=False)
    assert (plain[1] == np.arange(8)).all()
    assert np.array_equal(masked[0], plain[0]) and np.array_equal(masked[2], plain[2])
    assert not np.array_equal(masked[1], plain[1])


def test_take_rows_reorders_pieces_with_their_rows() -> None:
    lengths = np.array([4, 1, 6, 2])
    plan = PLANNERS["none"](starts_from_lengths(lengths), lengths, 4)
    taken = plan.take_rows(np.array([3, 0]))
    assert isinstance(taken, RowPlan) and taken.rows == 2
    assert taken.token_starts.tolist() == [plan.token_starts[3], plan.token_starts[0]]


# ---------------------------------------------------------------------------------------------
# the packed sampler
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def documents_file(tmp_path: Path) -> TokenFile:
    rng = np.random.default_rng(7)
    return write_documents(tmp_path / "docs", length_mix(rng, 16, count=300))


def _rows(batch: tuple[dict[str, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
    inputs, targets = batch
    return inputs["tokens"], inputs["positions"], targets


@pytest.mark.parametrize("packing", sorted(PLANNERS))
def test_sampler_epoch_covers_every_document_and_batches_are_valid(
    documents_file: TokenFile, packing: str
) -> None:
    batches = PackedBatches(documents_file, seq_len=16, global_batch_size=4, packing=packing)
    assert documents_file.documents is not None
    lengths = documents_file.documents.lengths
    document_of, document_start = document_tables(lengths)
    seen: list[np.ndarray] = []
    for _ in range(batches.steps_per_epoch):
        tokens, positions, targets = (t.numpy() for t in _rows(batches.next_batch()))
        assert tokens.shape == (4, 16) and tokens.dtype == np.int64
        pieces = check_rows(
            tokens, positions, targets, document_of, document_start, seq_len=16, packing=packing
        )
        seen += [np.array(p) for p in pieces]
    # The rows skipped at the end of the epoch hold the rest.
    skipped = batches.row_plan(0).take_rows(
        np.arange(batches.steps_per_epoch * 4, batches.num_rows)
    )
    rest = fill_rows(skipped, documents_file.tokens, pad_id=0)[0]
    everything = np.concatenate([*seen, rest[rest != 0]])
    assert np.array_equal(np.sort(everything), np.arange(1, documents_file.count + 1))
    # padding_fraction is the share of padding in the epoch's rows.
    assert batches.padding_fraction == pytest.approx(
        1 - documents_file.count / (batches.num_rows * 16)
    )
    assert batches.step == batches.steps_per_epoch and batches.epoch == 1


@pytest.mark.parametrize("packing", sorted(PLANNERS))
def test_dp_slices_concatenate_to_the_single_process_batch(
    documents_file: TokenFile, packing: str
) -> None:
    whole = PackedBatches(documents_file, seq_len=16, global_batch_size=4, packing=packing, seed=5)
    halves = [
        PackedBatches(
            documents_file,
            seq_len=16,
            global_batch_size=4,
            packing=packing,
            seed=5,
            dp_rank=rank,
            dp_size=2,
        )
        for rank in range(2)
    ]
    for step in (0, 1, whole.steps_per_epoch, whole.steps_per_epoch + 3):
        expected = _rows(whole.batch_at(step))
        parts = [_rows(half.batch_at(step)) for half in halves]
        for index in range(3):
            assert torch.equal(torch.cat([p[index] for p in parts]), expected[index])


@pytest.mark.parametrize("packing", sorted(PLANNERS))
def test_state_dict_resumes_with_identical_batches(documents_file: TokenFile, packing: str) -> None:
    def make(seed: int) -> PackedBatches:
        return PackedBatches(
            documents_file, seq_len=16, global_batch_size=4, packing=packing, seed=seed
        )

    run = make(seed=3)
    for _ in range(run.steps_per_epoch - 1):  # the resumed run crosses into the next epoch
        run.next_batch()
    state = run.state_dict()
    expected = [_rows(run.next_batch()) for _ in range(3)]
    resumed = make(seed=99)  # the saved seed wins
    resumed.load_state_dict(state)
    for want in expected:
        got = _rows(resumed.next_batch())
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # Another seed gives another order; another layout is refused.
    assert not torch.equal(_rows(make(seed=4).batch_at(0))[0], _rows(make(seed=3).batch_at(0))[0])
    other = PackedBatches(documents_file, seq_len=8, global_batch_size=4, packing=packing)
    with pytest.raises(DataError, match="seq_len"):
        other.load_state_dict(state)
    if packing != "none":
        with pytest.raises(DataError, match=r"num_windows|packing"):
            PackedBatches(
                documents_file, seq_len=16, global_batch_size=4, packing="none"
            ).load_state_dict(state)


@pytest.mark.parametrize("packing", sorted(PLANNERS))
def test_epochs_reshuffle_into_as_many_rows(documents_file: TokenFile, packing: str) -> None:
    batches = PackedBatches(documents_file, seq_len=16, global_batch_size=4, packing=packing)
    first = batches.row_plan(0)
    first_starts = first.token_starts.copy()
    second = batches.row_plan(1)
    assert second.rows == first.rows
    assert not np.array_equal(first_starts, second.token_starts)
    if packing == "first_fit":
        # First fit opens rows from the longest pieces to the shortest: the sampler shuffles
        # them, or every epoch would begin with its longest documents.
        leading = first.lengths[first.row_starts[:-1]]
        assert (np.diff(leading) > 0).any()


def test_eos_documents_score_the_eos_and_not_after_it(tmp_path: Path) -> None:
    from plait.plugins.data import prepare_documents

    source = tmp_path / "docs.txt"
    source.write_text("ab\n\ncde\n\nf", encoding="utf-8")
    report = prepare_documents([source], tmp_path / "out", separator="\n\n")
    token_file = TokenFile(report.directory)
    eos = report.eos.eos_id
    assert eos == 256 and token_file.vocab_size == 257 and token_file.meta.dtype == "uint16"
    batches = PackedBatches(token_file, seq_len=6, global_batch_size=2, packing="first_fit")
    rows = {}
    for step in range(batches.steps_per_epoch):
        inputs, targets = batches.batch_at(step)
        for tokens, positions, target in zip(
            inputs["tokens"], inputs["positions"], targets, strict=True
        ):
            rows[bytes(t for t in tokens.tolist() if t < 256)] = (positions, target)
    # First fit, longest first: "cde"+EOS (4 tokens), then "ab"+EOS (3) does not fit beside it,
    # then "f"+EOS (2) does. Padding is EOS, positions counting from 0 again.
    assert sorted(rows) == [b"ab", b"cdef"]
    positions, target = rows[b"cdef"]
    assert positions.tolist() == [0, 1, 2, 3, 0, 1]
    assert target.tolist() == [ord("d"), ord("e"), eos, -100, eos, -100]
    positions, target = rows[b"ab"]
    assert positions.tolist() == [0, 1, 2, 0, 1, 2]
    assert target.tolist() == [ord("b"), eos, -100, -100, -100, -100]


# ---------------------------------------------------------------------------------------------
# build_batches
# ---------------------------------------------------------------------------------------------


def test_build_batches_picks_the_sampler_by_directory(
    documents_file: TokenFile, tmp_path: Path
) -> None:
    common = dict(seq_len=16, global_batch_size=4, dp_rank=0, dp_size=1, seed=0)
    config = DataSection(path=str(documents_file.directory), packing="first_fit")
    packed = build_batches(config, **common)
    assert isinstance(packed, PackedBatches) and packed.packing == "first_fit"
    default = build_batches(DataSection(path=str(documents_file.directory)), **common)
    assert isinstance(default, PackedBatches) and default.packing == "concat_split"
    assert default.document_mask and (default.batch_at(0)[0]["positions"] == 0).sum() > 4
    unmasked = build_batches(
        DataSection(path=str(documents_file.directory), document_mask=False), **common
    )
    inputs, targets = unmasked.batch_at(0)
    assert (inputs["positions"] == torch.arange(16)).all()
    assert torch.equal(inputs["tokens"], default.batch_at(0)[0]["tokens"])
    assert torch.equal(targets, default.batch_at(0)[1])  # still nothing across documents
    # A held-out split packs the last documents only.
    train = build_batches(config, **common, holdout=0.2)
    validation = build_batches(config, **common, holdout=0.2, split="validation")
    assert isinstance(train, PackedBatches) and isinstance(validation, PackedBatches)
    assert train.num_documents + validation.num_documents == documents_file.documents.count
    assert validation.first_document == train.num_documents
    # A stream reads as before; asking it for a packing is an error naming the field.
    stream = tmp_path / "stream.txt"
    stream.write_text("x" * 500)
    from plait.plugins.data import prepare_token_files

    stream_dir = prepare_token_files([stream], tmp_path / "stream")
    assert isinstance(build_batches(DataSection(path=str(stream_dir)), **common), TokenBatches)
    with pytest.raises(DataError, match=r"data\.packing = 'none' needs document offsets"):
        build_batches(DataSection(path=str(stream_dir), packing="none"), **common)


def test_too_few_rows_is_an_error(tmp_path: Path) -> None:
    token_file = write_documents(tmp_path / "small", [3, 4])
    with pytest.raises(DataError, match="fewer than one global batch"):
        PackedBatches(token_file, seq_len=16, global_batch_size=4)
