"""`documents.bin`: where each document of a prepared token directory starts.

The file is one flat little-endian int64 array of start offsets into `tokens.bin`, one per
document, in token order; `meta.json` records how many (`documents`) and their SHA-256. The first
start is 0, starts increase strictly (no document is empty), and a document ends where the next
one starts, the last at the token count. Every document written by `plait data prepare` ends with
its EOS token, so its length counts the EOS.

A directory without the file (format version 1, or a stream prepared without documents, such as
the bundled corpus) has no boundaries: it is one token stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.plugins.data.errors import TokenFileError

DOCUMENTS_FILE = "documents.bin"
OFFSET_DTYPE = np.dtype("<i8")


@dataclass(frozen=True, slots=True, eq=False)
class DocumentIndex:
    """Start offsets and lengths of a token directory's documents (read-only arrays)."""

    starts: np.ndarray  # int64, (documents,)
    lengths: np.ndarray  # int64, (documents,)

    @classmethod
    def from_starts(
        cls, starts: np.ndarray, token_count: int, *, where: Path | str
    ) -> DocumentIndex:
        """Check `starts` against the token count and derive the lengths."""
        starts = np.asarray(starts, dtype=np.int64)
        if starts.ndim != 1:
            raise TokenFileError(f"{where}: document starts must be 1-D")
        if starts.size == 0:
            if token_count:
                raise TokenFileError(f"{where}: no document, but {token_count:,} tokens")
            return cls(starts=starts, lengths=np.empty(0, dtype=np.int64))
        if int(starts[0]) != 0:
            raise TokenFileError(f"{where}: the first document starts at {int(starts[0])}, not 0")
        lengths = np.diff(starts, append=np.int64(token_count))
        if (lengths <= 0).any():
            bad = int(np.flatnonzero(lengths <= 0)[0])
            raise TokenFileError(
                f"{where}: document {bad} starts at {int(starts[bad])} and is empty or out of "
                f"order (tokens: {token_count:,}); prepare the token files again"
            )
        return cls(starts=starts, lengths=lengths)

    @property
    def count(self) -> int:
        return int(self.starts.size)

    def __len__(self) -> int:
        return int(self.starts.size)


def read_documents(path: Path, *, documents: int, token_count: int) -> DocumentIndex:
    """Memory-map `documents.bin` and check it holds `documents` valid starts."""
    if not path.is_file():
        raise TokenFileError(f"{path}: missing (its meta.json records {documents:,} documents)")
    expected = documents * OFFSET_DTYPE.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise TokenFileError(
            f"{path}: {actual:,} bytes on disk, but meta.json records {documents:,} documents = "
            f"{expected:,} bytes; prepare the token files again"
        )
    # NOTE: np.memmap refuses zero-length files.
    starts = (
        np.memmap(path, dtype=OFFSET_DTYPE, mode="r", shape=(documents,))
        if documents
        else np.empty(0, dtype=OFFSET_DTYPE)
    )
    return DocumentIndex.from_starts(starts, token_count, where=path)


def starts_from_lengths(lengths: np.ndarray) -> np.ndarray:
    """Start offsets of documents of these lengths laid end to end, as `documents.bin` holds."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.zeros(lengths.size, dtype=OFFSET_DTYPE)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts
