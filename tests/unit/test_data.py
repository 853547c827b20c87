"""Tests of the data pipeline: tokenizer, token files, bundled corpus, sampler and `plait data`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from plait.core.config import DataSection
from plait.plugins.data import (
    ByteTokenizer,
    DataError,
    TokenBatches,
    TokenFile,
    TokenFileError,
    build_batches,
    bundled_corpus_dir,
    prepare_token_files,
    token_dtype,
)
from plait.plugins.data import token_files as token_files_module
from plait.plugins.data.tokenizer import document_eos
from plait.tools.data_commands import app

TEXT = "The quick brown fox — naïve café, 日本語, emoji 🦊.\nSecond line.\n"


class WideTokenizer:
    """A tokenizer with a 1000-id vocabulary, to exercise the uint16 layout."""

    name = "wide"
    vocab_size = 1000

    def encode(self, text: str) -> np.ndarray:
        return np.array([ord(c) % 1000 for c in text], dtype=np.int64)

    def decode(self, tokens: object) -> str:
        raise NotImplementedError


@pytest.fixture
def counting_file(tmp_path: Path) -> TokenFile:
    """A uint16 token file whose token i is i, so every batch shows where it was read from."""
    directory = tmp_path / "counting"
    directory.mkdir()
    count = 4001
    tokens = np.arange(count, dtype="<u2")
    tokens.tofile(directory / "tokens.bin")
    meta = {
        "format": "plait-tokens",
        "format_version": 1,
        "dtype": "uint16",
        "count": count,
        "vocab_size": 65536,
        "tokenizer": "counting",
        "sources": [],
        "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
    }
    (directory / "meta.json").write_text(json.dumps(meta))
    return TokenFile(directory, verify_checksum=True)


# ---------------------------------------------------------------------------------------------
# tokenizer and token files
# ---------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_non_ascii() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXT)
    assert ids.dtype == np.uint8
    assert len(ids) == len(TEXT.encode("utf-8")) > len(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode(ids.tolist()) == TEXT
    assert tokenizer.decode(torch.from_numpy(ids.astype(np.int64))) == TEXT
    # A window cut inside a multi-byte character decodes with a replacement, not an exception.
    assert tokenizer.decode(tokenizer.encode("é")[:1]) == "\ufffd"
    # The end of document `plait data prepare` appends is the one id past the bytes.
    assert document_eos(tokenizer).eos_id == 256
    assert tokenizer.decode([65, 256, 66, 67, 256]) == "A<|endoftext|>BC<|endoftext|>"
    with pytest.raises(ValueError, match="257"):
        tokenizer.decode([65, 257])
    with pytest.raises(ValueError, match="-1"):
        tokenizer.decode([-1, 65])


def test_token_dtype_follows_vocab_size() -> None:
    assert token_dtype(256) == np.uint8
    assert token_dtype(257) == np.uint16
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_prepare_then_memmap_round_trip(tmp_path: Path) -> None:
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(TEXT, encoding="utf-8")
    second.write_text("x" * 10 + "\n", encoding="utf-8")
    out = prepare_token_files([first, second], tmp_path / "out", tokenizer=ByteTokenizer())
    token_file = TokenFile(out, verify_checksum=True)
    expected = (TEXT + "x" * 10 + "\n").encode("utf-8")
    assert isinstance(token_file.tokens, np.memmap)
    assert token_file.tokens.dtype == np.uint8
    assert bytes(token_file.tokens) == expected
    meta = json.loads((out / "meta.json").read_text())
    assert meta["count"] == len(expected)
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint8"
    assert [s["tokens"] for s in meta["sources"]] == [len(TEXT.encode()), 11]
    assert [Path(s["path"]).name for s in meta["sources"]] == ["a.txt", "b.txt"]
    # Either file of the directory opens it too.
    assert TokenFile(out / "tokens.bin").count == TokenFile(out / "meta.json").count


def test_prepare_chunks_large_input_and_picks_uint16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tiny chunks force the streaming path, including a line longer than one chunk.
    monkeypatch.setattr(token_files_module, "READ_CHUNK_CHARS", 7)
    text = "short\n" + "a much longer line than one chunk\n" + "no newline at end"
    source = tmp_path / "in.txt"
    source.write_text(text, encoding="utf-8")
    out = prepare_token_files([source], tmp_path / "out", tokenizer=WideTokenizer())
    token_file = TokenFile(out, verify_checksum=True)
    assert token_file.dtype == np.dtype("<u2")
    assert token_file.tokens.tolist() == [ord(c) % 1000 for c in text]
    assert (out / "tokens.bin").stat().st_size == 2 * len(text)


def test_prepare_rejects_missing_and_empty_inputs(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope\.txt"):
        prepare_token_files([tmp_path / "nope.txt"], tmp_path / "out")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="no text"):
        prepare_token_files([empty], tmp_path / "out")
    assert not (tmp_path / "out").exists()  # no temporary files, nor the directory it made


def _prepared(tmp_path: Path) -> Path:
    source = tmp_path / "in.txt"
    source.write_text(TEXT * 20, encoding="utf-8")
    return prepare_token_files([source], tmp_path / "out")


def test_truncated_token_file_is_an_error_naming_it(tmp_path: Path) -> None:
    out = _prepared(tmp_path)
    data = (out / "tokens.bin").read_bytes()
    (out / "tokens.bin").write_bytes(data[:-3])
    with pytest.raises(TokenFileError, match=r"tokens\.bin: truncated") as info:
        TokenFile(out)
    assert str(out / "tokens.bin") in str(info.value)
    assert f"{len(data):,} bytes" in str(info.value)


def test_missing_and_corrupt_meta_are_errors_naming_it(tmp_path: Path) -> None:
    out = _prepared(tmp_path)
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text('{"format": "plait-tokens", "count": ')
    with pytest.raises(TokenFileError, match="not valid JSON") as info:
        TokenFile(out)
    assert str(meta_path) in str(info.value)
    meta_path.write_text(json.dumps({**meta, "count": "many"}))
    with pytest.raises(TokenFileError, match="'count' must be of type int"):
        TokenFile(out)
    meta_path.write_text(json.dumps({**meta, "dtype": "uint16"}))
    with pytest.raises(TokenFileError, match="does not match vocab_size 256"):
        TokenFile(out)
    meta_path.unlink()
    with pytest.raises(TokenFileError, match=r"meta\.json: missing"):
        TokenFile(out)
    with pytest.raises(TokenFileError, match="does not exist"):
        TokenFile(tmp_path / "elsewhere")


def test_flipped_bytes_fail_checksum_verification(tmp_path: Path) -> None:
    out = _prepared(tmp_path)
    data = bytearray((out / "tokens.bin").read_bytes())
    data[5] ^= 0xFF
    (out / "tokens.bin").write_bytes(bytes(data))
    TokenFile(out)  # same size: opening alone cannot tell
    with pytest.raises(TokenFileError, match="SHA-256"):
        TokenFile(out, verify_checksum=True)


def test_bundled_corpus_is_prepared_once_and_reused(tmp_path: Path) -> None:
    directory = bundled_corpus_dir(tmp_path)
    token_file = TokenFile(directory, verify_checksum=True)
    assert 300_000 <= token_file.count <= 1_000_000
    assert "statement" in ByteTokenizer().decode(token_file.tokens[:2000])
    mtime = (directory / "tokens.bin").stat().st_mtime_ns
    assert bundled_corpus_dir(tmp_path) == directory
    assert (directory / "tokens.bin").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [directory.name]  # no staging left over


def test_bundled_corpus_race_loser_uses_the_winners_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import plait.plugins.data.corpus as corpus

    winner = tmp_path / corpus.bundled_corpus_key()
    real_prepare = corpus.prepare_token_files

    def prepare_while_another_rank_finishes(inputs: list[Path], output: Path, **kwargs: object):
        # Another process renames its finished copy into place while this one is preparing.
        real_prepare(inputs, winner, **kwargs)
        (winner / "marker").touch()
        return real_prepare(inputs, output, **kwargs)

    monkeypatch.setattr(corpus, "prepare_token_files", prepare_while_another_rank_finishes)
    assert bundled_corpus_dir(tmp_path) == winner
    assert (winner / "marker").exists()  # the winner's directory was kept, not replaced
    assert [p.name for p in tmp_path.iterdir()] == [winner.name]


# ---------------------------------------------------------------------------------------------
# sampler
# ---------------------------------------------------------------------------------------------


def _window_starts(inputs: torch.Tensor) -> list[int]:
    return inputs[:, 0].tolist()


def test_batches_are_next_token_pairs_of_non_overlapping_windows(counting_file: TokenFile) -> None:
    batches = TokenBatches(counting_file, seq_len=16, global_batch_size=4, seed=3)
    inputs, targets = batches.next_batch()
    assert inputs.shape == targets.shape == (4, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.is_contiguous() and targets.is_contiguous()
    assert torch.equal(targets, inputs + 1)  # the counting file makes the shift visible
    assert all(start % 16 == 0 for start in _window_starts(inputs))
    assert torch.equal(inputs[:, 1:], inputs[:, :1] + torch.arange(1, 16))


def test_same_seed_same_batches_other_seed_other_batches(counting_file: TokenFile) -> None:
    def first_starts(seed: int) -> list[list[int]]:
        batches = TokenBatches(counting_file, seq_len=16, global_batch_size=4, seed=seed)
        return [_window_starts(batches.next_batch()[0]) for _ in range(5)]

    assert first_starts(7) == first_starts(7)
    assert first_starts(7) != first_starts(8)


def test_dp_slices_concatenate_to_the_single_process_batch(counting_file: TokenFile) -> None:
    common = {"seq_len": 16, "global_batch_size": 8, "seed": 11}
    single = TokenBatches(counting_file, **common)
    ranks = [TokenBatches(counting_file, dp_rank=r, dp_size=2, **common) for r in range(2)]
    quads = [TokenBatches(counting_file, dp_rank=r, dp_size=4, **common) for r in range(4)]
    for _ in range(6):
        inputs, targets = single.next_batch()
        pairs = [rank.next_batch() for rank in ranks]
        assert all(p[0].shape == (4, 16) for p in pairs)
        assert torch.equal(torch.cat([p[0] for p in pairs]), inputs)
        assert torch.equal(torch.cat([p[1] for p in pairs]), targets)
        assert torch.equal(torch.cat([q.next_batch()[0] for q in quads]), inputs)


def test_state_dict_restores_the_same_next_batches(counting_file: TokenFile) -> None:
    common = {"seq_len": 64, "global_batch_size": 4, "seed": 5}
    original = TokenBatches(counting_file, **common)
    for _ in range(30):  # past the first epoch boundary (62 windows -> 15 steps per epoch)
        original.next_batch()
    state = original.state_dict()
    assert state["step"] == 30 and state["epoch"] == 2 and state["seed"] == 5
    state = json.loads(json.dumps(state))  # survives a checkpoint's serialisation
    expected = [original.next_batch() for _ in range(20)]
    # A fresh sampler with another seed and another dp degree resumes the saved run.
    resumed = [
        TokenBatches(counting_file, dp_rank=r, dp_size=2, **{**common, "seed": 99})
        for r in range(2)
    ]
    for rank in resumed:
        rank.load_state_dict(state)
    for inputs, targets in expected:
        pairs = [rank.next_batch() for rank in resumed]
        assert torch.equal(torch.cat([p[0] for p in pairs]), inputs)
        assert torch.equal(torch.cat([p[1] for p in pairs]), targets)


def test_epoch_rollover_covers_every_window_then_reshuffles(counting_file: TokenFile) -> None:
    batches = TokenBatches(counting_file, seq_len=16, global_batch_size=5, seed=0)
    assert batches.num_windows == 4000 // 16 == 250
    assert batches.steps_per_epoch == 50
    epochs = []
    for _ in range(2):
        starts = [s for _ in range(50) for s in _window_starts(batches.next_batch()[0])]
        epochs.append(starts)
    assert sorted(epochs[0]) == sorted(epochs[1]) == [w * 16 for w in range(250)]
    assert epochs[0] != epochs[1]
    assert batches.epoch == 2 and batches.step == 100


def test_leftover_windows_are_skipped_per_epoch_not_lost(counting_file: TokenFile) -> None:
    batches = TokenBatches(counting_file, seq_len=16, global_batch_size=8, seed=1)
    assert batches.steps_per_epoch == 31  # 250 windows: 2 left over each epoch
    seen: set[int] = set()
    for _ in range(31 * 3):
        seen.update(_window_starts(batches.next_batch()[0]))
    assert len(seen) == 250


def test_sampler_configuration_errors(counting_file: TokenFile) -> None:
    with pytest.raises(ValueError, match=r"global_batch_size=6.*dp_size=4"):
        TokenBatches(counting_file, seq_len=16, global_batch_size=6, dp_rank=0, dp_size=4)
    with pytest.raises(DataError, match="fewer than one global batch"):
        TokenBatches(counting_file, seq_len=1000, global_batch_size=8)
    with pytest.raises(DataError, match="dp_rank"):
        TokenBatches(counting_file, seq_len=16, global_batch_size=4, dp_rank=2, dp_size=2)
    batches = TokenBatches(counting_file, seq_len=16, global_batch_size=4)
    other = TokenBatches(counting_file, seq_len=8, global_batch_size=4)
    with pytest.raises(DataError, match="seq_len=16"):
        other.load_state_dict(batches.state_dict())


def test_build_batches_reads_path_or_bundled_corpus(
    counting_file: TokenFile, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    explicit = build_batches(
        DataSection(path=str(counting_file.directory)),
        seq_len=16,
        global_batch_size=4,
        dp_rank=1,
        dp_size=2,
        seed=0,
    )
    assert explicit.next_batch()[0].shape == (2, 16)
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    bundled = build_batches(
        DataSection(), seq_len=64, global_batch_size=4, dp_rank=0, dp_size=1, seed=0
    )
    assert bundled.token_file.directory.parent == tmp_path / "cache"
    assert bundled.vocab_size == 256
    inputs, targets = bundled.next_batch()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < 256


# ---------------------------------------------------------------------------------------------
# `plait data`
# ---------------------------------------------------------------------------------------------


def test_cli_prepare_writes_token_files_and_prints_summary(tmp_path: Path) -> None:
    source = tmp_path / "corpus.txt"
    source.write_text(TEXT * 3, encoding="utf-8")
    out = tmp_path / "tokens"
    runner = CliRunner()
    result = runner.invoke(app, ["prepare", str(source), "-o", str(out)])
    assert result.exit_code == 0, result.output
    count = len((TEXT * 3).encode("utf-8")) + 1  # one document, ended by EOS = 256
    assert TokenFile(out, verify_checksum=True).count == count
    assert f"{count:,}" in result.output and "uint16" in _unwrapped(result.output)
    info = runner.invoke(app, ["info", str(out), "--verify"])
    assert info.exit_code == 0 and "(verified)" in _unwrapped(info.output)
    missing = runner.invoke(app, ["prepare", str(tmp_path / "nope.txt"), "-o", str(out)])
    assert missing.exit_code == 1 and "is not a file" in _unwrapped(missing.output)
    unknown = runner.invoke(app, ["prepare", str(source), "-o", str(out), "-t", "bpe"])
    assert unknown.exit_code == 1 and "unknown tokenizer 'bpe'" in _unwrapped(unknown.output)


def _unwrapped(output: str) -> str:
    return " ".join(output.split())


def test_a_failed_prepare_leaves_no_directory_it_created(tmp_path: Path) -> None:
    not_utf8 = tmp_path / "latin1.txt"
    not_utf8.write_bytes("café\n".encode("latin-1"))
    out = tmp_path / "new" / "tokens"
    result = CliRunner().invoke(app, ["prepare", str(not_utf8), "-o", str(out)])
    assert result.exit_code == 1 and "is not UTF-8 text" in _unwrapped(result.output)
    assert not (tmp_path / "new").exists()  # neither the output nor the parent it made
    # A directory that existed before keeps its files; only the temporary files go.
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    result = CliRunner().invoke(app, ["prepare", str(not_utf8), "-o", str(existing)])
    assert result.exit_code == 1
    assert [p.name for p in existing.iterdir()] == ["notes.txt"]


# ---------------------------------------------------------------------------------------------
# a Hugging Face tokenizers file
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE of 400 ids trained on the bundled corpus by the `tokenizers` library,
    plus one token added after training (id 400, outside the BPE model's own vocabulary)."""
    tokenizers = pytest.importorskip("tokenizers")
    from plait.plugins.data.corpus import bundled_corpus_file

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train([str(bundled_corpus_file())], trainer)
    tokenizer.add_tokens(["<|user|>"])
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_prepare_with_a_tokenizers_file(tmp_path: Path, bpe_file: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    source = tmp_path / "corpus.txt"
    text = TEXT + "<|user|> def main(argv):\n    return parser.parse_args(argv)\n" * 20
    source.write_text(text, encoding="utf-8")
    out = tmp_path / "bpe-tokens"
    result = CliRunner().invoke(app, ["prepare", str(source), "-o", str(out), "-t", str(bpe_file)])
    assert result.exit_code == 0, result.output
    token_file = TokenFile(out, verify_checksum=True)
    reference = HFTokenizer.from_file(str(bpe_file))
    # The library's own ids, in order, then the file's own EOS ending the one document.
    expected = [*reference.encode(text, add_special_tokens=False).ids]
    eos = reference.token_to_id("<|endoftext|>")
    assert token_file.meta.eos_id == eos and token_file.tokens.tolist() == [*expected, eos]
    assert token_file.vocab_size == reference.get_vocab_size(with_added_tokens=True) == 401
    assert 400 in expected  # the added token is counted in the vocabulary
    assert token_file.meta.dtype == "uint16"  # 401 ids do not fit a byte
    assert token_file.meta.tokenizer.startswith("tokenizer.json (BPE")
    assert token_file.count < len(text.encode("utf-8")) / 1.5  # merges learned on the corpus
    assert reference.decode(token_file.tokens[:-1].tolist()) == text  # byte-level BPE is lossless
    # The sampler reads it like any token file.
    inputs, targets = TokenBatches(token_file, seq_len=8, global_batch_size=2).next_batch()
    assert int(inputs.max()) < 401 and torch.equal(inputs[:, 1:], targets[:, :-1])


def test_a_file_that_is_not_a_tokenizer_is_an_error(tmp_path: Path) -> None:
    source = tmp_path / "corpus.txt"
    source.write_text(TEXT, encoding="utf-8")
    bogus = tmp_path / "tokenizer.json"
    bogus.write_text('{"not": "a tokenizer"}')
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["prepare", str(source), "-o", str(out), "-t", str(bogus)])
    assert result.exit_code == 1
    assert "is not a tokenizers file" in _unwrapped(result.output)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# held-out split
# ---------------------------------------------------------------------------------------------


def test_the_held_out_split_is_the_tail_and_never_trained_on(counting_file: TokenFile) -> None:
    from plait.plugins.data.sampler import split_windows

    total = (counting_file.count - 1) // 16  # 250 windows
    splits = split_windows(counting_file.count, 16, 0.1)
    assert splits == {"train": (0, 225), "validation": (225, 25)}
    train = TokenBatches(counting_file, seq_len=16, global_batch_size=4, windows=splits["train"])
    held = TokenBatches(
        counting_file, seq_len=16, global_batch_size=4, windows=splits["validation"]
    )
    first_held_token = 225 * 16
    seen_train = {s for _ in range(3 * train.steps_per_epoch) for s in _starts(train)}
    seen_held = {s for _ in range(held.steps_per_epoch) for s in _starts(held)}
    assert max(seen_train) < first_held_token <= min(seen_held)
    assert seen_train == {w * 16 for w in range(225)}  # three epochs reach every window
    assert len(seen_held) == 24  # one epoch of whole batches of the 25 held-out windows
    assert total == 250
    # The split changes the layout a checkpoint records, so a resume across it is refused.
    whole = TokenBatches(counting_file, seq_len=16, global_batch_size=4)
    with pytest.raises(DataError, match="num_windows"):
        train.load_state_dict(whole.state_dict())


def test_build_batches_splits_only_when_asked(counting_file: TokenFile) -> None:
    config = DataSection(path=str(counting_file.directory), seq_len=16)
    common = dict(seq_len=16, global_batch_size=4, dp_rank=0, dp_size=1, seed=0)
    assert build_batches(config, **common).num_windows == 250
    assert build_batches(config, **common, holdout=0.2).num_windows == 200
    assert build_batches(config, **common, holdout=0.2, split="validation").num_windows == 50
    with pytest.raises(DataError, match="fewer than one global batch"):
        build_batches(
            config, **{**common, "global_batch_size": 8}, holdout=0.02, split="validation"
        )


def _starts(batches: TokenBatches) -> list[int]:
    return _window_starts(batches.next_batch()[0])
