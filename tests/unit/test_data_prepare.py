"""`prepare_documents`: every corpus format gives the same documents, bad rows are counted and
named, a file that is not what its suffix says is an error naming it, and any number of
tokenizing processes writes the same bytes."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from plait.core.config import DataSection
from plait.plugins.data import (
    DataError,
    TokenBatches,
    TokenFile,
    build_batches,
    prepare_documents,
)
from plait.plugins.data import corpus_readers as readers_module
from plait.plugins.data import token_files as token_files_module
from plait.plugins.data.tokenizer import ByteTokenizer, TokenizerFile
from plait.tools.data_commands import app

DOCS = [
    "The first document.\nIt has two lines.",
    "naïve café — 日本語 🦊",
    "x",
    "  leading and trailing spaces are kept  ",
    "A longer one. " * 40,
]


def documents_of(token_file: TokenFile) -> list[str]:
    """The text of every document, checking each ends with the EOS id."""
    assert token_file.documents is not None
    eos = token_file.meta.eos_id
    texts = []
    for start, length in zip(
        token_file.documents.starts, token_file.documents.lengths, strict=True
    ):
        ids = token_file.tokens[start : start + length]
        assert int(ids[-1]) == eos
        texts.append(bytes(ids[:-1].astype(np.uint8)).decode("utf-8"))
    return texts


def write_jsonl(path: Path, rows: list[object]) -> Path:
    lines = "".join(
        (row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n"
        for row in rows
    )
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(lines.encode("utf-8")))
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def write_parquet(path: Path, column: list[object], name: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({name: column, "id": list(range(len(column)))}), path, row_group_size=2)
    return path


def test_every_format_gives_the_same_documents(tmp_path: Path) -> None:
    import datasets

    rows = [{"text": doc, "meta": i} for i, doc in enumerate(DOCS)]
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    dict_folder = tmp_path / "saved_dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}
    ).save_to_disk(str(dict_folder))
    separated = tmp_path / "docs.txt"
    separated.write_text("\n===\n".join(DOCS) + "\n===\n", encoding="utf-8")
    per_file = []
    for i, doc in enumerate(DOCS):
        per_file.append(tmp_path / f"doc{i}.txt")
        per_file[-1].write_text(doc, encoding="utf-8")
    inputs: dict[str, tuple[list[Path], dict[str, str]]] = {
        "jsonl": ([write_jsonl(tmp_path / "c.jsonl", rows)], {}),
        "jsonl.gz": ([write_jsonl(tmp_path / "c.jsonl.gz", rows)], {}),
        "parquet": ([write_parquet(tmp_path / "c.parquet", list(DOCS))], {}),
        "datasets": ([folder], {}),
        "DatasetDict": ([dict_folder], {"split": "train"}),
        "txt separator": ([separated], {"separator": "\n===\n"}),
        "txt per file": (per_file, {}),
    }
    for kind, (paths, options) in inputs.items():
        report = prepare_documents(paths, tmp_path / f"out-{kind}", **options)
        token_file = TokenFile(report.directory, verify_checksum=True)
        assert documents_of(token_file) == DOCS, kind
        assert report.skipped == {} and token_file.meta.format_version == 2, kind
        assert token_file.meta.documents == len(DOCS)
    other_column = write_parquet(tmp_path / "body.parquet", list(DOCS), name="body")
    report = prepare_documents([other_column], tmp_path / "out-body", text_field="body")
    assert documents_of(TokenFile(report.directory)) == DOCS


def test_a_long_text_file_is_one_document_read_in_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(token_files_module, "READ_CHUNK_CHARS", 16)
    text = "\n\n  \n" + "".join(f"line {i} of a long book\n" for i in range(50)) + "no newline"
    source = tmp_path / "book.txt"
    source.write_text(text, encoding="utf-8")
    report = prepare_documents([source], tmp_path / "out")
    assert documents_of(TokenFile(report.directory)) == [text]
    blank = tmp_path / "blank.txt"
    blank.write_text("\n \n" * 20)
    report = prepare_documents([source, blank], tmp_path / "out2")
    assert report.skipped == {"empty": 1} and report.bad_rows[0].source == str(blank)


def test_bad_rows_are_counted_by_reason_and_named(tmp_path: Path) -> None:
    import datasets

    jsonl = write_jsonl(
        tmp_path / "rows.jsonl",
        [
            {"text": "good one"},
            {"body": "no text field"},
            {"text": 42},
            "{not json",
            {"text": "   "},
            ["a", "list"],
            {"text": None},
            {"text": "good two"},
        ],
    )
    parquet = write_parquet(tmp_path / "rows.parquet", ["good three", None, "", "good four"])
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["good five", None]}).save_to_disk(str(folder))
    separated = tmp_path / "rows.txt"
    separated.write_text("good six\n\n\n\ngood seven\n\n", encoding="utf-8")
    report = prepare_documents(
        [jsonl, parquet, folder, separated], tmp_path / "out", separator="\n\n"
    )
    token_file = TokenFile(report.directory)
    assert documents_of(token_file) == [
        f"good {n}" for n in ["one", "two", "three", "four", "five", "six", "seven"]
    ]
    assert report.skipped == {
        "empty": 3,  # "   " in the JSON Lines, "" in the Parquet, "" between two separators
        "invalid JSON": 1,
        "missing field": 4,  # no "text", null, a Parquet null, a datasets None
        "not a string": 1,
        "not an object": 1,
    }
    assert token_file.meta.skipped_rows == report.skipped
    assert [s.skipped_rows for s in token_file.meta.sources] == [6, 2, 1, 1]
    assert [s.documents for s in token_file.meta.sources] == [2, 2, 1, 2]
    named = [bad.describe() for bad in report.bad_rows]
    assert named[:6] == [
        f"{jsonl} row 2: missing field",
        f"{jsonl} row 3: not a string (int)",
        f"{jsonl} row 4: invalid JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))",
        f"{jsonl} row 5: empty",
        f"{jsonl} row 6: not an object (list)",
        f"{jsonl} row 7: missing field (null)",
    ]
    assert named[6:] == [
        f"{parquet} row 2: missing field (null)",
        f"{parquet} row 3: empty",
        f"{folder} row 2: missing field (null)",
        f"{separated} row 2: empty",
    ]


def test_only_the_first_bad_rows_are_listed(tmp_path: Path) -> None:
    rows = [{"text": "kept"}] + [{"text": ""}] * 25
    report = prepare_documents([write_jsonl(tmp_path / "r.jsonl", rows)], tmp_path / "out")
    assert report.skipped == {"empty": 25} and report.skipped_total == 25
    assert [bad.row for bad in report.bad_rows] == list(range(2, 12))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("x.parquet", b"just some text\n", r"x\.parquet' is not a Parquet file"),
        ("x.jsonl", b"plain prose, not JSON\nmore prose\n", r"x\.jsonl' is not JSON Lines"),
        ("x.jsonl", b"PAR1\x00\x15\x04\xff\xfe", r"x\.jsonl' is not JSON Lines"),
        ("x.jsonl.gz", b'{"text": "not compressed"}\n', r"x\.jsonl\.gz' is not a gzip"),
        ("x.csv", b"text\nhello\n", r"x\.csv': unknown kind of file; plait reads \.txt"),
        ("x.txt", "café".encode("latin-1"), r"x\.txt' is not UTF-8 text"),
    ],
)
def test_a_file_that_is_not_what_its_suffix_says_is_an_error_naming_it(
    tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    out = tmp_path / "new" / "out"
    with pytest.raises(DataError, match=message):
        prepare_documents([path], out)
    assert not (tmp_path / "new").exists()  # the write is atomic: nothing is left behind


def test_missing_or_wrong_columns_and_folders_are_errors_naming_them(tmp_path: Path) -> None:
    import datasets

    parquet = write_parquet(tmp_path / "c.parquet", ["a", "b"], name="body")
    with pytest.raises(DataError, match=r"has no column 'text'; its columns are \['body', 'id'\]"):
        prepare_documents([parquet], tmp_path / "out")
    with pytest.raises(DataError, match=r"column 'id' of .*c\.parquet' holds int64, not text"):
        prepare_documents([parquet], tmp_path / "out", text_field="id")
    not_a_dataset = tmp_path / "folder"
    not_a_dataset.mkdir()
    (not_a_dataset / "notes.md").write_text("hi")
    with pytest.raises(DataError, match=r"folder' is a folder but not a datasets save_to_disk"):
        prepare_documents([not_a_dataset], tmp_path / "out")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(
        str(saved)
    )
    with pytest.raises(DataError, match=r"without split 'test'; its splits are \['train'\]"):
        prepare_documents([saved], tmp_path / "out", split="test")
    with pytest.raises(DataError, match="hold no document"):
        prepare_documents([write_jsonl(tmp_path / "e.jsonl", [{"text": ""}])], tmp_path / "out")


def test_several_processes_write_the_same_bytes_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small batches so the rows of each file spread over many tasks on both processes.
    monkeypatch.setattr(readers_module, "BATCH_ROWS", 7)
    rng = np.random.default_rng(0)
    words = np.array(["plait", "packs", "rows", "of", "documents", "ünïcode", "\n"])
    rows = [
        {"text": " ".join(rng.choice(words, size=int(rng.integers(1, 60))))} for _ in range(300)
    ]
    rows[17] = {"text": ""}
    first = write_jsonl(tmp_path / "a.jsonl", rows)
    second = write_parquet(tmp_path / "b.parquet", [r["text"] for r in rows[:120]])
    bpe = _small_bpe(tmp_path)
    for tokenizer in (ByteTokenizer(), bpe):
        outputs = []
        for workers in (1, 2):
            out = tmp_path / f"out-{tokenizer.name[:4]}-{workers}"
            prepare_documents([first, second], out, tokenizer=tokenizer, workers=workers)
            outputs.append(out)
        for name in ("tokens.bin", "documents.bin", "meta.json"):
            one, two = ((o / name).read_bytes() for o in outputs)
            assert hashlib.sha256(one).digest() == hashlib.sha256(two).digest(), name


def _small_bpe(tmp_path: Path) -> TokenizerFile:
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["</s>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(["plait packs rows of documents"] * 50, trainer)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return TokenizerFile(path)


def test_the_eos_comes_from_the_tokenizer_or_is_added(tmp_path: Path) -> None:
    bpe = _small_bpe(tmp_path)
    assert bpe.eos_id == bpe._tokenizer.token_to_id("</s>")  # a special token named like EOS
    # A tokenizer_config.json beside the file names the EOS, as save_pretrained writes it.
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "a"}}))
    assert TokenizerFile(tmp_path / "tokenizer.json").eos_id == bpe._tokenizer.token_to_id("a")
    source = write_jsonl(tmp_path / "c.jsonl", [{"text": "plait packs"}])
    report = prepare_documents([source], tmp_path / "out", tokenizer=bpe)
    assert not report.eos.added and report.meta.vocab_size == bpe.vocab_size
    report = prepare_documents([source], tmp_path / "byte")
    assert report.eos.added and (report.eos.eos_id, report.meta.vocab_size) == (256, 257)


def test_a_version_1_directory_reads_as_one_stream(tmp_path: Path) -> None:
    directory = tmp_path / "v1"
    directory.mkdir()
    tokens = np.arange(600, dtype=np.uint8) % 200
    tokens.tofile(directory / "tokens.bin")
    meta = {
        "format": "plait-tokens",
        "format_version": 1,
        "dtype": "uint8",
        "count": 600,
        "vocab_size": 256,
        "tokenizer": "byte",
        "sources": [{"path": "old.txt", "bytes": 600, "tokens": 600}],
        "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
    }
    (directory / "meta.json").write_text(json.dumps(meta))
    token_file = TokenFile(directory, verify_checksum=True)
    assert token_file.documents is None and token_file.meta.eos_id is None
    batches = build_batches(
        DataSection(path=str(directory)),
        seq_len=8,
        global_batch_size=2,
        dp_rank=0,
        dp_size=1,
        seed=0,
    )
    assert isinstance(batches, TokenBatches)
    info = CliRunner().invoke(app, ["info", str(directory)])
    assert info.exit_code == 0 and "one token stream (format version 1)" in info.output


def test_a_corrupt_documents_file_is_an_error(tmp_path: Path) -> None:
    rows = [{"text": "one"}, {"text": "two"}, {"text": "three"}]
    out = prepare_documents([write_jsonl(tmp_path / "c.jsonl", rows)], tmp_path / "out").directory
    starts = np.fromfile(out / "documents.bin", dtype="<i8")
    starts[::-1].tofile(out / "documents.bin")
    with pytest.raises(DataError, match=r"documents\.bin: the first document starts at 8"):
        TokenFile(out)
    starts[[0, 2, 1]].tofile(out / "documents.bin")  # out of order
    with pytest.raises(DataError, match=r"documents\.bin: document 1 starts at 8 and is empty"):
        TokenFile(out)
    (out / "documents.bin").write_bytes(b"\x00" * 8)
    with pytest.raises(
        DataError, match=r"documents\.bin: 8 bytes on disk, but meta\.json records 3"
    ):
        TokenFile(out)


def test_the_package_gives_the_function_whatever_was_imported_before() -> None:
    # A submodule named like the function would replace it on the package once imported
    # (`plait data prepare` imports the module that defines it).
    import importlib

    import plait.plugins.data as data
    import plait.plugins.data.corpus_preparation  # noqa: F401

    assert callable(data.prepare_documents)
    assert callable(importlib.import_module("plait.plugins.data").prepare_documents)
