"""`prepare_documents`: tokenize corpora into a token directory with document offsets.

    report = prepare_documents(["corpus.jsonl.gz", "more.parquet"], "tokens/",
                               tokenizer=get_tokenizer("byte"), workers=4)
    report.meta.documents, report.skipped          # documents written, bad rows by reason

Inputs are read in order by `corpus_readers` (one document per row; bad rows counted and named,
never fatal); every document is tokenized, followed by the EOS token (`tokenizer.document_eos`),
and its start offset goes to `documents.bin`. Tokenizing runs on `workers` processes, each batch
of rows on whichever process is free, but results are written in input order, so the output is
byte-identical for any number of workers. The write is atomic like every token directory's.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.plugins.data.corpus_readers import (
    BadRow,
    ReadBatch,
    TextRecord,
    input_size,
    read_corpus,
)
from plait.plugins.data.errors import DataError
from plait.plugins.data.token_files import (
    SourceFile,
    TokenDirectoryWriter,
    TokenFileMeta,
    check_ids,
)
from plait.plugins.data.tokenizer import (
    ByteTokenizer,
    DocumentEos,
    Tokenizer,
    document_eos,
    token_dtype,
)

# Bad rows listed by name in the report (all are counted by reason).
LISTED_BAD_ROWS = 10

Progress = Callable[[int, int], None]  # (input bytes read, input bytes in all)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepareReport:
    """What `prepare_documents` wrote, and what it skipped."""

    directory: Path
    meta: TokenFileMeta
    eos: DocumentEos
    bad_rows: tuple[BadRow, ...]  # the first LISTED_BAD_ROWS, in input order
    skipped: dict[str, int]  # bad rows by reason

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())


class PreparationTally:
    """What a preparation counts while it writes a directory — bad rows by reason (the first
    `LISTED_BAD_ROWS` named), tokens and documents per input — and the `meta.json` and report
    made of it. Shared by `prepare_documents` and `prepare_conversations`."""

    def __init__(self, paths: Sequence[Path], sizes: Sequence[int]) -> None:
        self.paths, self.sizes = list(paths), list(sizes)
        self.listed: list[BadRow] = []
        self.skipped: Counter[str] = Counter()
        self.per_source = [Counter[str]() for _ in self.paths]

    def bad(self, index: int, row: BadRow) -> None:
        self.skipped[row.reason] += 1
        self.per_source[index]["skipped"] += 1
        if len(self.listed) < LISTED_BAD_ROWS:
            self.listed.append(row)

    def wrote(self, index: int, *, tokens: int, documents: int) -> None:
        self.per_source[index]["tokens"] += tokens
        self.per_source[index]["documents"] += documents

    def commit(
        self, writer: TokenDirectoryWriter, *, eos: DocumentEos, tokenizer: str, nothing: str
    ) -> TokenFileMeta:
        """`meta.json` for what `writer` holds; a `DataError` (`nothing`, with the reasons the
        rows were skipped) when it holds no document."""
        if writer.document_count == 0:
            reasons = ", ".join(f"{n} {r}" for r, n in sorted(self.skipped.items())) or "no rows"
            raise DataError(nothing.format(inputs=[str(p) for p in self.paths], reasons=reasons))
        return writer.commit(
            vocab_size=eos.vocab_size,
            tokenizer=tokenizer,
            eos_id=eos.eos_id,
            skipped_rows=dict(sorted(self.skipped.items())),
            sources=tuple(
                SourceFile(
                    path=str(path.resolve()),
                    bytes=size,
                    tokens=counts["tokens"],
                    documents=counts["documents"],
                    skipped_rows=counts["skipped"],
                )
                for path, size, counts in zip(self.paths, self.sizes, self.per_source, strict=True)
            ),
        )

    def report(
        self, output_dir: Path | str, meta: TokenFileMeta, eos: DocumentEos
    ) -> PrepareReport:
        return PrepareReport(
            directory=Path(output_dir),
            meta=meta,
            eos=eos,
            bad_rows=tuple(self.listed),
            skipped=dict(sorted(self.skipped.items())),
        )


def default_workers() -> int:
    """min(4, the CPUs this process may run on)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cpus or 1))


def prepare_documents(
    inputs: Sequence[Path | str],
    output_dir: Path | str,
    *,
    tokenizer: Tokenizer | None = None,
    text_field: str = "text",
    separator: str | None = None,
    split: str = "train",
    workers: int = 1,
    progress: Progress | None = None,
) -> PrepareReport:
    """Tokenize the documents of `inputs` into `output_dir` (tokens.bin, documents.bin,
    meta.json). Bad rows are skipped and reported; no document at all is a `DataError`."""
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    paths = [Path(p) for p in inputs]
    if not paths:
        raise DataError("prepare_documents needs at least one input")
    for path in paths:
        if not path.exists():
            raise DataError(f"input {str(path)!r} is not a file or folder")
    if workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")
    eos = document_eos(tokenizer)
    dtype = token_dtype(eos.vocab_size)
    sizes = [input_size(path) for path in paths]
    total_size = sum(sizes)
    tally = PreparationTally(paths, sizes)
    with TokenDirectoryWriter(output_dir, dtype=dtype, documents=True) as writer:
        read = _read_all(paths, text_field=text_field, separator=separator, split=split)
        in_document = False  # the last record written continues into the next
        for index, batch, ids, lengths in _tokenized(read, tokenizer, dtype, workers):
            texts = [r for r in batch.records if isinstance(r, TextRecord)]
            for bad in (r for r in batch.records if isinstance(r, BadRow)):
                tally.bad(index, bad)
            if texts:
                ends = np.fromiter((r.ends_document for r in texts), dtype=bool, count=len(texts))
                tokens, starts = _with_eos(ids, lengths, ends, eos.eos_id, continues=in_document)
                writer.write(tokens, document_starts=starts)
                in_document = not bool(ends[-1])
                tally.wrote(index, tokens=len(tokens), documents=int(ends.sum()))
            if progress is not None:
                progress(sum(sizes[:index]) + min(batch.progress, sizes[index]), total_size)
        meta = tally.commit(
            writer,
            eos=eos,
            tokenizer=tokenizer.name,
            nothing="inputs {inputs} hold no document ({reasons}); "
            "check --text-field and --separator",
        )
    return tally.report(output_dir, meta, eos)


def _read_all(
    paths: Sequence[Path], *, text_field: str, separator: str | None, split: str
) -> Iterator[tuple[int, ReadBatch]]:
    for index, path in enumerate(paths):
        for batch in read_corpus(path, text_field=text_field, separator=separator, split=split):
            yield index, batch


def _with_eos(
    ids: np.ndarray, lengths: np.ndarray, ends: np.ndarray, eos_id: int, *, continues: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The records' tokens with EOS after each record that ends its document, and the offsets
    where documents begin (every record but one continuing the previous record's document)."""
    ends_at = np.cumsum(lengths)
    tokens = np.insert(ids, ends_at[ends], eos_id)
    # Each record moves by the EOS tokens inserted before it.
    record_starts = ends_at - lengths + np.concatenate(([0], np.cumsum(ends)[:-1]))
    begins = np.concatenate(([not continues], ends[:-1]))
    return tokens, record_starts[begins]


# ---------------------------------------------------------------------------------------------
# tokenizing, in this process or on a pool of processes
# ---------------------------------------------------------------------------------------------

_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode(
    tokenizer: Tokenizer, texts: list[str], dtype: np.dtype, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """The texts' ids end to end in `dtype`, and each text's count."""
    pieces = [np.asarray(tokenizer.encode(text)) for text in texts]
    for ids in pieces:
        check_ids(ids, tokenizer.vocab_size, tokenizer.name, where)
    lengths = np.fromiter((len(ids) for ids in pieces), dtype=np.int64, count=len(pieces))
    joined = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
    return joined.astype(dtype, copy=False), lengths


def _encode_in_worker(texts: list[str], dtype: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None
    return _encode(_worker_tokenizer, texts, np.dtype(dtype), where)


def _tokenized(
    read: Iterator[tuple[int, ReadBatch]], tokenizer: Tokenizer, dtype: np.dtype, workers: int
) -> Iterator[tuple[int, ReadBatch, np.ndarray, np.ndarray]]:
    """`(input index, batch, ids, lengths)` in input order."""
    if workers == 1:
        for index, batch in read:
            texts = [r.text for r in batch.records if isinstance(r, TextRecord)]
            yield index, batch, *_encode(tokenizer, texts, dtype, _where_or_empty(batch))
        return
    # NOTE: spawned, not forked: the reading process may run pyarrow's threads, and a fork
    # copies their locks in whatever state they are.
    context = multiprocessing.get_context("spawn")
    window: deque[tuple[int, ReadBatch, Future[tuple[np.ndarray, np.ndarray]]]] = deque()
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(tokenizer,)
    ) as pool:
        for index, batch in read:
            texts = [r.text for r in batch.records if isinstance(r, TextRecord)]
            future = pool.submit(_encode_in_worker, texts, dtype.str, _where_or_empty(batch))
            window.append((index, batch, future))
            # A bounded window keeps every worker busy without reading the corpus ahead into
            # memory (Pool.imap would queue every batch at once).
            if len(window) >= 2 * workers:
                done_index, done_batch, done = window.popleft()
                yield done_index, done_batch, *done.result()
        while window:
            done_index, done_batch, done = window.popleft()
            yield done_index, done_batch, *done.result()


def _where_or_empty(batch: ReadBatch) -> str:
    """Where a batch's rows come from, for a tokenizer's error."""
    if not batch.records:
        return "no rows"
    first, last = batch.records[0], batch.records[-1]
    return f"{first.source} rows {first.row}-{last.row}"
