"""Corpus readers: the documents of one input (text, JSON Lines, Parquet, a `datasets` folder).

Every reader yields `ReadBatch`es of records in file order: a `TextRecord` is a document's text
(or a piece of it, for a long text file), a `BadRow` a row that holds no usable text, named by
file, 1-based row number and reason. A bad row never stops the run; a file that is not what its
suffix says, or lacks the text column altogether, is a `DataError` naming it.

- `.txt`: the whole file is one document, or with a `separator` each piece between
  separators is one (a trailing separator ends the last document); row = the piece's number;
- `.jsonl`, `.jsonl.gz`: one JSON object per line, its `text_field`; row = the line number;
- `.parquet`: the `text_field` column, read with pyarrow one batch at a time; row = the row;
- a folder: a `datasets` `save_to_disk` folder (of a `DatasetDict`, its `split`), its
  `text_field`; row = the row.

Text that is empty or only whitespace is a bad row (`empty`).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from plait.plugins.data.errors import DataError
from plait.plugins.data.token_files import text_chunks

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet", "a datasets save_to_disk folder")
# Records per batch handed to the tokenizing workers: large enough that a batch outweighs the
# cost of sending it to a process, small enough to keep the progress bar moving.
BATCH_ROWS = 1024
BATCH_CHARS = 1 << 22
# A JSON Lines file none of whose first lines parses as JSON is not JSON Lines: an error, rather
# than millions of bad rows.
SNIFF_LINES = 100


@dataclass(frozen=True, slots=True)
class TextRecord:
    """Text of a document; `ends_document=False`: the document continues in the next record."""

    source: str
    row: int
    text: str
    ends_document: bool = True


@dataclass(frozen=True, slots=True)
class BadRow:
    """A row that holds no document: `reason` is the category totals are kept by."""

    source: str
    row: int
    reason: str  # "missing field", "not a string", "empty", "invalid JSON", "not an object"
    detail: str = ""

    def describe(self) -> str:
        return f"{self.source} row {self.row}: {self.reason}" + (
            f" ({self.detail})" if self.detail else ""
        )


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """Records of one input, and how far into it (in bytes of `input_size`) they reach.
    (`chat_readers` fills them with conversations instead of texts.)"""

    records: list[Any]  # TextRecord | BadRow, or a reader's own record | BadRow
    progress: int


class FieldCheck(Protocol):
    """Turns one row's field into a record, or the `BadRow` saying why it holds none."""

    def __call__(self, source: str, row: int, value: Any, *, present: bool = True) -> Any: ...


class ColumnCheck(Protocol):
    """Raises a `DataError` naming the input when a table's column cannot hold the field."""

    def __call__(self, schema: Any, field: str, source: str) -> None: ...


def input_size(path: Path) -> int:
    """Bytes on disk of an input: a file's size, or the sum of a folder's files."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def read_corpus(
    path: Path, *, text_field: str = "text", separator: str | None = None, split: str = "train"
) -> Iterator[ReadBatch]:
    """The records of `path`, by its suffix (or a folder); an unknown kind is a `DataError`."""
    name = path.name.lower()
    if path.is_dir():
        return read_datasets_field(
            path, field=text_field, split=split, check=check_text, check_column=_check_column
        )
    if not path.is_file():
        raise DataError(f"input {str(path)!r} is neither a file nor a folder")
    if name.endswith(".txt"):
        return _read_text(path, separator=separator)
    if name.endswith((".jsonl", ".jsonl.gz")):
        return read_jsonl_field(path, field=text_field, check=check_text)
    if name.endswith(".parquet"):
        return read_parquet_field(
            path, field=text_field, check=check_text, check_column=_check_column
        )
    raise DataError(f"input {str(path)!r}: unknown kind of file; plait reads {', '.join(SUFFIXES)}")


def check_text(source: str, row: int, value: Any, *, present: bool = True) -> TextRecord | BadRow:
    """A record for one row's text field, or the reason it is bad."""
    if not present:
        return BadRow(source, row, "missing field")
    if value is None:
        return BadRow(source, row, "missing field", "null")
    if not isinstance(value, str):
        return BadRow(source, row, "not a string", type(value).__name__)
    if not value.strip():
        return BadRow(source, row, "empty")
    return TextRecord(source, row, value)


class _Batcher:
    """Collects records into `ReadBatch`es of about `BATCH_ROWS` rows or `BATCH_CHARS` chars."""

    def __init__(self) -> None:
        self.records: list[Any] = []
        self.chars = 0

    def add(self, record: Any) -> bool:
        """Add `record`; True when the batch is full."""
        self.records.append(record)
        if not isinstance(record, BadRow):
            self.chars += record.chars() if hasattr(record, "chars") else len(record.text)
        return len(self.records) >= BATCH_ROWS or self.chars >= BATCH_CHARS

    def take(self, progress: int) -> ReadBatch:
        batch = ReadBatch(self.records, progress)
        self.records, self.chars = [], 0
        return batch


# ---------------------------------------------------------------------------------------------
# text files
# ---------------------------------------------------------------------------------------------


def _read_text(path: Path, *, separator: str | None) -> Iterator[ReadBatch]:
    source, size = str(path), path.stat().st_size
    if separator is None:
        yield from _read_whole_text(path, source, size)
        return
    if not separator:
        raise DataError("--separator must not be empty")
    batcher = _Batcher()
    row, carry, done = 0, "", 0
    for chunk in text_chunks(path):
        done += len(chunk)
        pieces = (carry + chunk).split(separator)
        carry = pieces.pop()
        for piece in pieces:
            row += 1
            if batcher.add(check_text(source, row, piece)):
                yield batcher.take(min(done, size))
    # A separator ends a document, so text after the last one that is only whitespace (the
    # file's final newline) is no document.
    if carry.strip() or row == 0:
        batcher.add(check_text(source, row + 1, carry))
    yield batcher.take(size)


def _read_whole_text(path: Path, source: str, size: int) -> Iterator[ReadBatch]:
    """One document: the file, in newline-cut pieces so a large file never sits in memory."""
    # A piece is sent once the next one shows it is not the last, and only once some text has
    # shown the document is not empty.
    pending, has_text, done = "", False, 0
    for chunk in text_chunks(path):
        done += len(chunk)
        if pending and has_text:
            yield ReadBatch([TextRecord(source, 1, pending, ends_document=False)], done)
            pending = ""
        pending += chunk
        has_text = has_text or bool(chunk.strip())
    record = TextRecord(source, 1, pending) if has_text else BadRow(source, 1, "empty")
    yield ReadBatch([record], size)


# ---------------------------------------------------------------------------------------------
# JSON Lines
# ---------------------------------------------------------------------------------------------


def read_jsonl_field(path: Path, *, field: str, check: FieldCheck) -> Iterator[ReadBatch]:
    """The records `check` makes of each line's `field`; lines that are not JSON objects are
    bad rows, and a file none of whose first lines is JSON is a `DataError`."""
    # NOTE: rows are parsed with the standard json module, line by line, rather than with
    # pyarrow.json or datasets' json builder: those fail the whole file on one malformed line and
    # unify a column's type across rows, while a corpus needs each bad row named and skipped.
    source = str(path)
    batcher = _Batcher()
    sniffed = parsed = 0
    first_error = ""
    with path.open("rb") as raw:
        lines: BinaryIO = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
        try:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
                    record: Any = BadRow(source, number, "invalid JSON", str(exc))
                    first_error = first_error or f"line {number}: {exc}"
                else:
                    parsed += 1
                    record = (
                        check(source, number, row.get(field), present=field in row)
                        if isinstance(row, dict)
                        else BadRow(source, number, "not an object", type(row).__name__)
                    )
                sniffed += 1
                if sniffed == SNIFF_LINES and not parsed:
                    break
                if batcher.add(record):
                    yield batcher.take(raw.tell())
        except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
            raise DataError(f"input {source!r} is not a gzip-compressed file: {exc}") from None
    if sniffed and not parsed:
        raise DataError(
            f"input {source!r} is not JSON Lines: none of its first {sniffed} lines is JSON "
            f"({first_error})"
        )
    yield batcher.take(path.stat().st_size)


# ---------------------------------------------------------------------------------------------
# Parquet and datasets folders
# ---------------------------------------------------------------------------------------------


def _check_column(schema: Any, field: str, source: str) -> None:
    import pyarrow as pa

    names = list(schema.names)
    if field not in names:
        raise DataError(
            f"input {source!r} has no column {field!r}; its columns are {names}: name the "
            "text column with --text-field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_view(kind)):
        raise DataError(f"column {field!r} of {source!r} holds {kind}, not text (a string column)")


def _is_view(kind: Any) -> bool:
    import pyarrow as pa

    is_string_view = getattr(pa.types, "is_string_view", None)
    return bool(is_string_view and is_string_view(kind))


def read_parquet_field(
    path: Path, *, field: str, check: FieldCheck, check_column: ColumnCheck
) -> Iterator[ReadBatch]:
    """The records `check` makes of column `field` of a Parquet file, one batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = str(path)
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"input {source!r} is not a Parquet file: {exc}") from None
    check_column(parquet.schema_arrow, field, source)
    yield from _arrow_rows(
        parquet.iter_batches(batch_size=BATCH_ROWS, columns=[field]),
        source=source,
        rows=parquet.metadata.num_rows,
        size=path.stat().st_size,
        check=check,
    )


def read_datasets_field(
    path: Path, *, field: str, split: str, check: FieldCheck, check_column: ColumnCheck
) -> Iterator[ReadBatch]:
    """The records `check` makes of column `field` of a `datasets` save_to_disk folder (of a
    `DatasetDict`: its `split`)."""
    import datasets

    source = str(path)
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(
            f"input {source!r} is a folder but not a datasets save_to_disk folder: {exc}"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"input {source!r} is a DatasetDict without split {split!r}; its splits are "
                f"{sorted(loaded)}: pick one with --split"
            )
        loaded = loaded[split]
        source = f"{source}[{split}]"
    table = loaded.with_format("arrow")
    check_column(table.data.schema, field, source)
    yield from _arrow_rows(
        (batch[field] for batch in table.iter(batch_size=BATCH_ROWS)),
        source=source,
        rows=len(loaded),
        size=input_size(path),
        check=check,
    )


def _arrow_rows(
    batches: Iterator[Any], *, source: str, rows: int, size: int, check: FieldCheck
) -> Iterator[ReadBatch]:
    """Records of arrow batches (record batches of one column, or columns) of one column."""
    batcher = _Batcher()
    row = 0
    for batch in batches:
        column = batch.column(0) if hasattr(batch, "num_columns") else batch
        for value in column.to_pylist():
            row += 1
            if batcher.add(check(source, row, value)):
                yield batcher.take(size * row // max(rows, 1))
    yield batcher.take(size)
