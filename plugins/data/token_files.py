"""Memory-mapped token files: `prepare_token_files` writes them, `TokenFile` reads them.

A prepared directory holds two files:

- `tokens.bin`: every token of every input file, concatenated in input order, as one flat
  little-endian array of the smallest unsigned dtype that holds the vocabulary (uint8 up to 256
  ids, uint16 up to 65,536, else uint32) — the layout nanoGPT and Megatron's `.bin` use, so
  training reads it through `np.memmap` without loading it and ranks share the page cache;
- `meta.json`: format version, dtype, token count, vocabulary size, tokenizer name, the source
  files with their sizes, and the SHA-256 of `tokens.bin`.

`meta.json` is written last and both files are renamed into place, so a directory with a
`meta.json` is complete; a crash mid-way leaves only hidden temporary files.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plait.core.errors import PlaitError
from plait.plugins.data.tokenizer import ByteTokenizer, Tokenizer, token_dtype

FORMAT = "plait-tokens"
FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"

# Text is tokenized in pieces of about this many characters, cut at a newline, so a multi-GB
# input never has to fit in memory (and a subword tokenizer never sees a word cut in two).
READ_CHUNK_CHARS = 1 << 24
_HASH_CHUNK_BYTES = 1 << 24


class DataError(PlaitError, ValueError):
    """Training data cannot be prepared or sampled as configured."""


class TokenFileError(DataError):
    """A token-file directory is missing, corrupt, truncated or inconsistent with its meta."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceFile:
    """One input of a prepared token file."""

    path: str
    bytes: int
    tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenFileMeta:
    """The contents of `meta.json`."""

    dtype: str
    count: int
    vocab_size: int
    tokenizer: str
    sources: tuple[SourceFile, ...]
    sha256: str
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
        if raw.get("format_version") != FORMAT_VERSION:
            raise TokenFileError(
                f"{where}: format_version {raw.get('format_version')!r} is not supported "
                f"(this plait reads version {FORMAT_VERSION}); prepare the files again"
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
        return cls(
            dtype=raw["dtype"],
            count=raw["count"],
            vocab_size=raw["vocab_size"],
            tokenizer=raw["tokenizer"],
            sources=sources,
            sha256=raw["sha256"],
        )


def prepare_token_files(
    inputs: Sequence[Path | str],
    output_dir: Path | str,
    *,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Tokenize `inputs` (UTF-8 text files) into `output_dir/tokens.bin` + `meta.json`.

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
    dtype = token_dtype(tokenizer.vocab_size).newbyteorder("<")
    out = Path(output_dir)
    created = [d for d in (out, *out.parents) if not d.exists()]  # deepest first
    out.mkdir(parents=True, exist_ok=True)
    suffix = f".tmp-{os.getpid()}"
    tmp_tokens = out / f".{TOKENS_FILE}{suffix}"
    tmp_meta = out / f".{META_FILE}{suffix}"
    digest = hashlib.sha256()
    sources: list[SourceFile] = []
    try:
        with tmp_tokens.open("wb") as sink:
            for path in paths:
                count = 0
                for text in _text_chunks(path):
                    ids = np.asarray(tokenizer.encode(text))
                    _check_ids(ids, tokenizer, path)
                    data = np.ascontiguousarray(ids, dtype=dtype).tobytes()
                    digest.update(data)
                    sink.write(data)
                    count += ids.size
                sources.append(
                    SourceFile(path=str(path.resolve()), bytes=path.stat().st_size, tokens=count)
                )
        total = sum(source.tokens for source in sources)
        if total == 0:
            raise DataError(f"inputs {[str(p) for p in paths]} contain no text")
        meta = TokenFileMeta(
            dtype=dtype.name,
            count=total,
            vocab_size=tokenizer.vocab_size,
            tokenizer=tokenizer.name,
            sources=tuple(sources),
            sha256=digest.hexdigest(),
        )
        tmp_meta.write_text(meta.to_json(), encoding="utf-8")
        # Drop the old meta first so a reader never pairs it with the new tokens.
        (out / META_FILE).unlink(missing_ok=True)
        os.replace(tmp_tokens, out / TOKENS_FILE)
        os.replace(tmp_meta, out / META_FILE)
    except BaseException:
        tmp_tokens.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)
        _remove_empty(created)
        raise
    return out


def _remove_empty(directories: Sequence[Path]) -> None:
    """Remove the directories a failed preparation created, deepest first, while empty."""
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return  # not empty (someone else wrote there) or already gone


def _text_chunks(path: Path) -> Iterator[str]:
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


def _check_ids(ids: np.ndarray, tokenizer: Tokenizer, path: Path) -> None:
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise DataError(
            f"tokenizer {tokenizer.name!r} returned {ids.dtype} of shape {ids.shape} for "
            f"{path}; expected a 1-D integer array"
        )
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
        raise DataError(
            f"tokenizer {tokenizer.name!r} produced ids outside [0, {tokenizer.vocab_size}) "
            f"for {path}"
        )


class TokenFile:
    """A prepared token directory, opened read-only through `np.memmap`.

    `path` may be the directory or either of its two files. Opening checks `meta.json` and that
    `tokens.bin` has exactly `count × itemsize` bytes; `verify_checksum=True` (or `verify()`)
    also re-hashes the tokens, which reads the whole file.
    """

    def __init__(self, path: Path | str, *, verify_checksum: bool = False) -> None:
        path = Path(path)
        self.directory = path.parent if path.name in (TOKENS_FILE, META_FILE) else path
        self.meta_path = self.directory / META_FILE
        self.tokens_path = self.directory / TOKENS_FILE
        self.meta = self._read_meta()
        self.dtype = np.dtype(self.meta.dtype).newbyteorder("<")
        self._check_size()
        # NOTE: np.memmap refuses zero-length files, hence the empty array for count == 0.
        self.tokens: np.ndarray = (
            np.memmap(self.tokens_path, dtype=self.dtype, mode="r", shape=(self.meta.count,))
            if self.meta.count
            else np.empty(0, dtype=self.dtype)
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
        """Re-hash `tokens.bin` and compare with `meta.json`; raise `TokenFileError` if unequal."""
        digest = hashlib.sha256()
        with self.tokens_path.open("rb") as source:
            while block := source.read(_HASH_CHUNK_BYTES):
                digest.update(block)
        if digest.hexdigest() != self.meta.sha256:
            raise TokenFileError(
                f"{self.tokens_path}: corrupt: SHA-256 {digest.hexdigest()} does not match "
                f"{self.meta.sha256} recorded in {META_FILE}"
            )

    @property
    def count(self) -> int:
        return self.meta.count

    @property
    def vocab_size(self) -> int:
        return self.meta.vocab_size

    @property
    def nbytes(self) -> int:
        return self.meta.count * self.dtype.itemsize

    def __len__(self) -> int:
        return self.meta.count

    def __repr__(self) -> str:
        return (
            f"TokenFile({str(self.directory)!r}, count={self.count:,}, dtype={self.meta.dtype}, "
            f"vocab_size={self.vocab_size}, tokenizer={self.meta.tokenizer!r})"
        )
