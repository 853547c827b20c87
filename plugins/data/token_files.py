"""Memory-mapped token files: `TokenDirectoryWriter` writes them, `TokenFile` reads them.

A prepared directory holds:

- `tokens.bin`: every token, in input order, as one flat little-endian array of the smallest
  unsigned dtype that holds the vocabulary (uint8 up to 256 ids, uint16 up to 65,536, else
  uint32) — the layout nanoGPT and Megatron's `.bin` use, so training reads it through
  `np.memmap` without loading it and ranks share the page cache;
- `documents.bin` (format version 2, when the tokens are documents): the int64 start offset of
  every document (`documents_file.py`); each document ends with the EOS token `eos_id`;
- `loss_mask.bin` (format version 3, when only some tokens are trained on, as for a chat's
  assistant turns): one uint8 per token, 1 where it is trained (`loss_mask_file.py`);
- `meta.json`: format version, dtype, token count, vocabulary size, tokenizer name, EOS id, the
  number of documents, the number of trained tokens, the sources with their sizes, rows skipped
  by reason, and the SHA-256 of the binary files.

`prepare_token_files` writes text files as one stream with no boundaries and no EOS (the bundled
corpus); `plait.plugins.data.corpus_preparation` writes documents and
`plait.plugins.data.chat_preparation` conversations with their loss mask. A version-1 directory
(written before documents existed) is still read, as one stream with no boundaries; a version-2
one (no loss mask) trains on every token. Only a directory with a loss mask is written as
version 3, so an older plait refuses it instead of training on the masked tokens.

`meta.json` is written last and every file is renamed into place, so a directory with a
`meta.json` is complete; a crash mid-way leaves only hidden temporary files.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from plait.plugins.data.documents_file import (
    DOCUMENTS_FILE,
    OFFSET_DTYPE,
    DocumentIndex,
    read_documents,
)
from plait.plugins.data.errors import DataError, TokenFileError
from plait.plugins.data.loss_mask_file import LOSS_MASK_FILE, MASK_DTYPE, read_loss_mask
from plait.plugins.data.tokenizer import ByteTokenizer, Tokenizer, token_dtype

FORMAT = "plait-tokens"
FORMAT_VERSION = 2
# A directory with loss_mask.bin; without one, directories stay version 2.
MASKED_FORMAT_VERSION = 3
# Version 1 had no documents.bin and no EOS: it reads as one stream.
READABLE_VERSIONS = (1, 2, 3)
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"

# Text is tokenized in pieces of about this many characters, cut at a newline, so a multi-GB
# input never has to fit in memory (and a subword tokenizer never sees a word cut in two).
READ_CHUNK_CHARS = 1 << 24
_HASH_CHUNK_BYTES = 1 << 24


__all__ = ["DataError", "TokenFile", "TokenFileError", "TokenFileMeta", "prepare_token_files"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceFile:
    """One input of a prepared token file."""

    path: str
    bytes: int
    tokens: int
    documents: int = 0
    skipped_rows: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenFileMeta:
    """The contents of `meta.json`. `documents` is `None` for a stream with no boundaries."""

    dtype: str
    count: int
    vocab_size: int
    tokenizer: str
    sources: tuple[SourceFile, ...]
    sha256: str
    documents: int | None = None
    documents_sha256: str | None = None
    eos_id: int | None = None
    trained_tokens: int | None = None  # tokens loss_mask.bin marks trained; None: no mask
    loss_mask_sha256: str | None = None
    skipped_rows: dict[str, int] = field(default_factory=dict)  # reason -> rows
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, raw: Any, *, where: Path) -> TokenFileMeta:
        """Validate a parsed `meta.json`; every problem names the file and the field."""
        if not isinstance(raw, dict):
            raise TokenFileError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        if raw.get("format") != FORMAT:
            raise TokenFileError(f"{where}: not a plait token file (format={raw.get('format')!r})")
        version = raw.get("format_version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            readable = " and ".join(str(v) for v in READABLE_VERSIONS)
            raise TokenFileError(
                f"{where}: format_version {version!r} is not supported "
                f"(this plait reads versions {readable}); prepare the files again"
            )
        expected = {"dtype": str, "count": int, "vocab_size": int, "tokenizer": str, "sha256": str}
        for name, kind in expected.items():
            value = raw.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise TokenFileError(
                    f"{where}: field {name!r} must be of type {kind.__name__}, got {value!r}"
                )
        if raw["count"] < 0 or raw["vocab_size"] <= 0:
            raise TokenFileError(
                f"{where}: count must be >= 0 and vocab_size > 0, got count={raw['count']}, "
                f"vocab_size={raw['vocab_size']}"
            )
        allowed = token_dtype(raw["vocab_size"]).name
        if raw["dtype"] != allowed:
            raise TokenFileError(
                f"{where}: dtype {raw['dtype']!r} does not match vocab_size {raw['vocab_size']} "
                f"(expected {allowed!r})"
            )
        try:
            sources = tuple(SourceFile(**source) for source in raw.get("sources", []))
        except TypeError as exc:
            raise TokenFileError(f"{where}: malformed 'sources' entry: {exc}") from None
        documents = _optional(raw, "documents", int, where)
        if documents is not None and not 0 < documents <= max(raw["count"], 1):
            raise TokenFileError(
                f"{where}: documents must be in [1, count={raw['count']}], got {documents}"
            )
        eos_id = _optional(raw, "eos_id", int, where)
        if eos_id is not None and not 0 <= eos_id < raw["vocab_size"]:
            raise TokenFileError(
                f"{where}: eos_id {eos_id} is outside the vocabulary [0, {raw['vocab_size']})"
            )
        trained = _optional(raw, "trained_tokens", int, where)
        if (trained is not None) != (version == MASKED_FORMAT_VERSION):
            raise TokenFileError(
                f"{where}: format version {version} "
                + ("needs" if trained is None else "has no")
                + f" 'trained_tokens' (only version {MASKED_FORMAT_VERSION} has a loss mask)"
            )
        if trained is not None and not 0 <= trained <= raw["count"]:
            raise TokenFileError(
                f"{where}: trained_tokens must be in [0, count={raw['count']}], got {trained}"
            )
        skipped = raw.get("skipped_rows", {})
        if not isinstance(skipped, dict) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in skipped.items()
        ):
            raise TokenFileError(f"{where}: 'skipped_rows' must map reasons to counts")
        return cls(
            dtype=raw["dtype"],
            count=raw["count"],
            vocab_size=raw["vocab_size"],
            tokenizer=raw["tokenizer"],
            sources=sources,
            sha256=raw["sha256"],
            documents=documents,
            documents_sha256=_optional(raw, "documents_sha256", str, where),
            eos_id=eos_id,
            trained_tokens=trained,
            loss_mask_sha256=_optional(raw, "loss_mask_sha256", str, where),
            skipped_rows=dict(skipped),
            format_version=version,
        )


def _optional(raw: dict[str, Any], name: str, kind: type, where: Path) -> Any:
    value = raw.get(name)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise TokenFileError(
            f"{where}: field {name!r} must be of type {kind.__name__} or null, got {value!r}"
        )
    return value


class TokenDirectoryWriter:
    """Writes one token directory atomically: tokens (and document starts) go to hidden
    temporary files, `commit` renames them into place with `meta.json` last, and leaving the
    `with` block without a commit removes them and any directory it created.

        with TokenDirectoryWriter(out, dtype=np.dtype("<u2"), documents=True) as writer:
            writer.write(ids, document_starts=np.array([0, 7]))  # two documents begin in ids
            writer.commit(vocab_size=..., tokenizer=..., sources=...)

    `loss_mask=True` also writes `loss_mask.bin`: every `write` then gives the tokens' mask.
    """

    def __init__(
        self, output_dir: Path | str, *, dtype: np.dtype, documents: bool, loss_mask: bool = False
    ) -> None:
        self.directory = Path(output_dir)
        self.dtype = dtype.newbyteorder("<")
        self.documents = documents
        self.loss_mask = loss_mask
        self.trained_tokens = 0
        self._mask_digest = hashlib.sha256()
        self.count = 0
        self.document_count = 0
        self._digest = hashlib.sha256()
        self._starts: list[np.ndarray] = []
        self._pending_starts = 0
        self._starts_digest = hashlib.sha256()
        suffix = f".tmp-{os.getpid()}"
        self._tmp_tokens = self.directory / f".{TOKENS_FILE}{suffix}"
        self._tmp_documents = self.directory / f".{DOCUMENTS_FILE}{suffix}"
        self._tmp_meta = self.directory / f".{META_FILE}{suffix}"
        self._tmp_mask = self.directory / f".{LOSS_MASK_FILE}{suffix}"
        self._created: list[Path] = []
        self._committed = False

    def __enter__(self) -> TokenDirectoryWriter:
        self._created = [d for d in (self.directory, *self.directory.parents) if not d.exists()]
        self.directory.mkdir(parents=True, exist_ok=True)
        self._tokens_sink = self._tmp_tokens.open("wb")
        self._documents_sink = self._tmp_documents.open("wb") if self.documents else None
        self._mask_sink = self._tmp_mask.open("wb") if self.loss_mask else None
        return self

    def write(
        self,
        ids: np.ndarray,
        *,
        document_starts: np.ndarray | None = None,
        loss_mask: np.ndarray | None = None,
    ) -> None:
        """Append `ids`; `document_starts` are the offsets into `ids` where documents begin,
        `loss_mask` (a writer opened with `loss_mask=True`) which of `ids` are trained."""
        if (loss_mask is not None) != self.loss_mask:
            raise DataError(
                "a writer opened with loss_mask="
                f"{self.loss_mask} was given {'a' if loss_mask is not None else 'no'} loss mask"
            )
        if loss_mask is not None:
            assert self._mask_sink is not None
            if len(loss_mask) != len(ids):
                raise DataError(f"a loss mask of {len(loss_mask)} entries for {len(ids)} tokens")
            mask = np.ascontiguousarray(loss_mask, dtype=bool).astype(MASK_DTYPE).tobytes()
            self._mask_digest.update(mask)
            self._mask_sink.write(mask)
            self.trained_tokens += int(np.count_nonzero(loss_mask))
        if document_starts is not None and len(document_starts):
            if not self.documents:
                raise DataError("document starts given to a writer opened with documents=False")
            self._starts.append(np.asarray(document_starts, dtype=OFFSET_DTYPE) + self.count)
            self.document_count += len(document_starts)
            self._pending_starts += len(document_starts)
            # Starts are flushed in blocks so millions of documents stay off the heap.
            if self._pending_starts >= 1 << 16:
                self._flush_starts()
        data = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self._digest.update(data)
        self._tokens_sink.write(data)
        self.count += len(ids)

    def _flush_starts(self) -> None:
        assert self._documents_sink is not None
        for block in self._starts:
            data = block.tobytes()
            self._starts_digest.update(data)
            self._documents_sink.write(data)
        self._starts.clear()
        self._pending_starts = 0

    def commit(self, **meta_fields: Any) -> TokenFileMeta:
        """Write `meta.json` from `meta_fields` plus what was written, and rename into place."""
        if self.documents:
            self._flush_starts()
            assert self._documents_sink is not None
            self._documents_sink.close()
        self._tokens_sink.close()
        if self._mask_sink is not None:
            self._mask_sink.close()
        meta = TokenFileMeta(
            dtype=self.dtype.name,
            count=self.count,
            sha256=self._digest.hexdigest(),
            documents=self.document_count if self.documents else None,
            documents_sha256=self._starts_digest.hexdigest() if self.documents else None,
            trained_tokens=self.trained_tokens if self.loss_mask else None,
            loss_mask_sha256=self._mask_digest.hexdigest() if self.loss_mask else None,
            format_version=MASKED_FORMAT_VERSION if self.loss_mask else FORMAT_VERSION,
            **meta_fields,
        )
        self._tmp_meta.write_text(meta.to_json(), encoding="utf-8")
        # Drop the old meta first so a reader never pairs it with the new tokens.
        (self.directory / META_FILE).unlink(missing_ok=True)
        os.replace(self._tmp_tokens, self.directory / TOKENS_FILE)
        if self.documents:
            os.replace(self._tmp_documents, self.directory / DOCUMENTS_FILE)
        else:
            (self.directory / DOCUMENTS_FILE).unlink(missing_ok=True)  # a stale one
        if self.loss_mask:
            os.replace(self._tmp_mask, self.directory / LOSS_MASK_FILE)
        else:
            (self.directory / LOSS_MASK_FILE).unlink(missing_ok=True)  # a stale one
        os.replace(self._tmp_meta, self.directory / META_FILE)
        self._committed = True
        return meta

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._tokens_sink.close()
        if self._documents_sink is not None:
            self._documents_sink.close()
        if self._mask_sink is not None:
            self._mask_sink.close()
        if not self._committed:
            for path in (self._tmp_tokens, self._tmp_documents, self._tmp_meta, self._tmp_mask):
                path.unlink(missing_ok=True)
            _remove_empty(self._created)


def prepare_token_files(
    inputs: Sequence[Path | str],
    output_dir: Path | str,
    *,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Tokenize `inputs` (UTF-8 text files) into one stream `output_dir/tokens.bin` +
    `meta.json`, with no document boundaries and no EOS (documents: `prepare_documents`).

    Returns `output_dir`. The tokenizer defaults to `ByteTokenizer`. Existing files in
    `output_dir` are replaced atomically; a failure leaves no directory this call created.
    """
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    paths = [Path(p) for p in inputs]
    if not paths:
        raise DataError("prepare_token_files needs at least one input file")
    for path in paths:
        if not path.is_file():
            raise DataError(f"input {str(path)!r} is not a file")
    dtype = token_dtype(tokenizer.vocab_size)
    sources: list[SourceFile] = []
    with TokenDirectoryWriter(output_dir, dtype=dtype, documents=False) as writer:
        for path in paths:
            before = writer.count
            for text in text_chunks(path):
                ids = np.asarray(tokenizer.encode(text))
                check_ids(ids, tokenizer.vocab_size, tokenizer.name, path)
                writer.write(ids)
            sources.append(
                SourceFile(
                    path=str(path.resolve()),
                    bytes=path.stat().st_size,
                    tokens=writer.count - before,
                )
            )
        if writer.count == 0:
            raise DataError(f"inputs {[str(p) for p in paths]} contain no text")
        writer.commit(
            vocab_size=tokenizer.vocab_size, tokenizer=tokenizer.name, sources=tuple(sources)
        )
    return Path(output_dir)


def _remove_empty(directories: Sequence[Path]) -> None:
    """Remove the directories a failed preparation created, deepest first, while empty."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return  # not empty (someone else wrote there) or already gone


def text_chunks(path: Path) -> Iterator[str]:
    """The file's text in pieces of about `READ_CHUNK_CHARS`, each ending at a newline."""
    carry = ""
    try:
        with path.open(encoding="utf-8", newline="") as source:
            while piece := source.read(READ_CHUNK_CHARS):
                text = carry + piece
                cut = text.rfind("\n") + 1
                if cut == 0:
                    carry = text
                    continue
                carry = text[cut:]
                yield text[:cut]
    except UnicodeDecodeError as exc:
        raise DataError(f"input {str(path)!r} is not UTF-8 text: {exc}") from None
    if carry:
        yield carry


def check_ids(ids: np.ndarray, vocab_size: int, name: str, where: Path | str) -> None:
    """A tokenizer's output must be a 1-D integer array of ids inside its vocabulary."""
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise DataError(
            f"tokenizer {name!r} returned {ids.dtype} of shape {ids.shape} for "
            f"{where}; expected a 1-D integer array"
        )
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise DataError(f"tokenizer {name!r} produced ids outside [0, {vocab_size}) for {where}")


class TokenFile:
    """A prepared token directory, opened read-only through `np.memmap`.

    `path` may be the directory or any of its files. Opening checks `meta.json`, that
    `tokens.bin` has exactly `count × itemsize` bytes and that `documents.bin`, if the meta
    records documents, holds valid starts; `verify_checksum=True` (or `verify()`) also re-hashes
    the files, which reads them whole. `documents` is `None` for a stream with no boundaries;
    `loss_mask` (uint8, 1 = trained) is `None` when every token is trained.
    """

    def __init__(self, path: Path | str, *, verify_checksum: bool = False) -> None:
        path = Path(path)
        self.directory = (
            path.parent
            if path.name in (TOKENS_FILE, META_FILE, DOCUMENTS_FILE, LOSS_MASK_FILE)
            else path
        )
        self.meta_path = self.directory / META_FILE
        self.tokens_path = self.directory / TOKENS_FILE
        self.documents_path = self.directory / DOCUMENTS_FILE
        self.loss_mask_path = self.directory / LOSS_MASK_FILE
        self.meta = self._read_meta()
        self.dtype = np.dtype(self.meta.dtype).newbyteorder("<")
        self._check_size()
        # NOTE: np.memmap refuses zero-length files, hence the empty array for count == 0.
        self.tokens: np.ndarray = (
            np.memmap(self.tokens_path, dtype=self.dtype, mode="r", shape=(self.meta.count,))
            if self.meta.count
            else np.empty(0, dtype=self.dtype)
        )
        self.documents: DocumentIndex | None = (
            read_documents(
                self.documents_path, documents=self.meta.documents, token_count=self.meta.count
            )
            if self.meta.documents is not None
            else None
        )
        self.loss_mask: np.ndarray | None = (
            read_loss_mask(
                self.loss_mask_path,
                token_count=self.meta.count,
                trained_tokens=self.meta.trained_tokens,
            )
            if self.meta.trained_tokens is not None
            else None
        )
        if verify_checksum:
            self.verify()

    def _read_meta(self) -> TokenFileMeta:
        if not self.directory.is_dir():
            raise TokenFileError(f"token directory {str(self.directory)!r} does not exist")
        if not self.meta_path.is_file():
            raise TokenFileError(
                f"{self.meta_path}: missing; create it with `plait data prepare FILES -o "
                f"{self.directory}`"
            )
        try:
            raw = json.loads(self.meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"{self.meta_path}: corrupt, not valid JSON ({exc})") from None
        return TokenFileMeta.from_dict(raw, where=self.meta_path)

    def _check_size(self) -> None:
        if not self.tokens_path.is_file():
            raise TokenFileError(f"{self.tokens_path}: missing (its {META_FILE} exists)")
        expected = self.meta.count * self.dtype.itemsize
        actual = self.tokens_path.stat().st_size
        if actual != expected:
            state = "truncated" if actual < expected else "longer than its meta says"
            raise TokenFileError(
                f"{self.tokens_path}: {state}: {actual:,} bytes on disk, but {META_FILE} "
                f"records {self.meta.count:,} {self.meta.dtype} tokens = {expected:,} bytes; "
                "prepare the token files again"
            )

    def verify(self) -> None:
        """Re-hash the binary files and compare with `meta.json`; raise `TokenFileError` if
        they differ."""
        checks = [(self.tokens_path, self.meta.sha256)]
        if self.meta.documents_sha256 is not None:
            checks.append((self.documents_path, self.meta.documents_sha256))
        if self.meta.loss_mask_sha256 is not None:
            checks.append((self.loss_mask_path, self.meta.loss_mask_sha256))
        for path, recorded in checks:
            digest = hashlib.sha256()
            with path.open("rb") as source:
                while block := source.read(_HASH_CHUNK_BYTES):
                    digest.update(block)
            if digest.hexdigest() != recorded:
                raise TokenFileError(
                    f"{path}: corrupt: SHA-256 {digest.hexdigest()} does not match "
                    f"{recorded} recorded in {META_FILE}"
                )

    @property
    def count(self) -> int:
        return self.meta.count

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    @property
    def has_documents(self) -> bool:
        return self.documents is not None

    @property
    def nbytes(self) -> int:
        return self.meta.count * self.dtype.itemsize

    def __len__(self) -> int:
        return self.meta.count

    def __repr__(self) -> str:
        return (
            f"TokenFile({str(self.directory)!r}, count={self.count:,}, dtype={self.meta.dtype}, "
            f"vocab_size={self.vocab_size}, tokenizer={self.meta.tokenizer!r}, "
            f"documents={self.meta.documents}, trained_tokens={self.meta.trained_tokens})"
        )
