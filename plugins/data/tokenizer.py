"""Tokenizers for token-file preparation: the `Tokenizer` protocol and the byte-level default.

The byte tokenizer maps text to its UTF-8 bytes, so its vocabulary is exactly 256 ids, it needs
no vocabulary file and no download, and every string round-trips. A Hugging Face `tokenizers`
file (`tokenizer.json`, as `Tokenizer.save` or `save_pretrained` writes it: BPE, WordPiece,
Unigram, …) is read by `TokenizerFile`; `get_tokenizer` takes either a name or such a path. Any
object with the same four members can be passed to `prepare_token_files` instead.

Documents end with an end-of-sequence token (`document_eos`): the tokenizer's own when it has
one (an `eos_id` attribute; a tokenizers file names it in a `tokenizer_config.json` beside it or
as a special token such as `<|endoftext|>` or `</s>`), else one id plait appends after the
vocabulary, which grows by one. For the byte tokenizer that is id 256 in a vocabulary of 257, so
its documents are stored as uint16: no byte value is given up as a marker, and every text still
round-trips.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    """What token-file preparation needs from a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, as a 1-D integer array."""
        ...

    def decode(self, tokens: Iterable[int] | np.ndarray) -> str:
        """The text of `tokens`."""
        ...


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary of `vocab_size`."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size {vocab_size} does not fit in 32-bit token ids")


# How `ByteTokenizer.decode` shows the end of a document (GPT-2's name for its EOS token).
END_OF_DOCUMENT_TEXT = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, lossless for any text, nothing to download.

    `decode` replaces byte sequences that are not valid UTF-8 (a window cut in the middle of a
    multi-byte character) with U+FFFD instead of raising, since sampled windows start anywhere.
    Id 256, the end of document that `plait data prepare` appends (`document_eos`), decodes to
    `END_OF_DOCUMENT_TEXT`.
    """

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text` as a uint8 array (copy, so callers may write to it)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, tokens: Iterable[int] | np.ndarray) -> str:
        # Lists, arrays and CPU tensors convert directly; a bare iterator is drained once.
        ids = np.asarray(tokens) if hasattr(tokens, "__len__") else np.fromiter(tokens, np.int64)
        if ids.size == 0:
            return ""
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"byte tokens must be integers, got dtype {ids.dtype}")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high > self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"byte token {bad} is outside the vocabulary [0, {self.vocab_size}] "
                f"({self.vocab_size}: the end of a document)"
            )
        ends = np.flatnonzero(ids == self.vocab_size)
        pieces = np.split(ids, ends)
        texts = [pieces[0], *(piece[1:] for piece in pieces[1:])]  # each after an end drops it
        return END_OF_DOCUMENT_TEXT.join(
            piece.astype(np.uint8).tobytes().decode("utf-8", errors="replace") for piece in texts
        )

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


# Special tokens that end a document in common tokenizers (GPT-2/NeoX, Llama 3, SentencePiece
# models, Gemma), looked for when no tokenizer_config.json names the EOS.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


@dataclass(frozen=True, slots=True, kw_only=True)
class DocumentEos:
    """How documents end: token `eos_id`, in a vocabulary of `vocab_size` ids."""

    eos_id: int
    vocab_size: int
    added: bool  # True: plait appended the id after the tokenizer's own vocabulary


def document_eos(tokenizer: Tokenizer) -> DocumentEos:
    """The token that ends every document: the tokenizer's `eos_id` if it has one, else a new
    id equal to its vocabulary size (the vocabulary grows by one)."""
    own = getattr(tokenizer, "eos_id", None)
    if own is not None:
        if not 0 <= own < tokenizer.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer.name!r} names eos_id {own}, outside its vocabulary "
                f"[0, {tokenizer.vocab_size})"
            )
        return DocumentEos(eos_id=int(own), vocab_size=tokenizer.vocab_size, added=False)
    return DocumentEos(eos_id=tokenizer.vocab_size, vocab_size=tokenizer.vocab_size + 1, added=True)


class TokenizerFile:
    """A Hugging Face `tokenizers` file (`tokenizer.json`): its model, normalizer and
    pre-tokenizer exactly as saved. Special tokens are not added around each piece of text (plait
    ends documents with `eos_id` itself); the vocabulary counts the added tokens too."""

    def __init__(self, path: Path | str) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ValueError(
                f"reading the tokenizer file {str(path)!r} needs the `tokenizers` package "
                "(pip install tokenizers)"
            ) from None
        self.path = Path(path)
        try:
            self._tokenizer = HFTokenizer.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise ValueError(f"{self.path} is not a tokenizers file: {exc}") from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        model = type(self._tokenizer.model).__name__
        self.name = f"{self.path.name} ({model}, tokenizers)"
        self.eos_id = self._find_eos()

    def _find_eos(self) -> int | None:
        """The EOS id: `eos_token` of a tokenizer_config.json beside the file (as
        `save_pretrained` writes it), else the first special token named in `EOS_TOKENS`."""
        config = self.path.with_name("tokenizer_config.json")
        if config.is_file():
            try:
                eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
                raise ValueError(f"{config} is not a JSON object: {exc}") from None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str) and (token_id := self._tokenizer.token_to_id(eos)) is not None:
                return token_id
        special = {
            token.content: token_id
            for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
            if token.special
        }
        return next((special[name] for name in EOS_TOKENS if name in special), None)

    def encode(self, text: str) -> np.ndarray:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def decode(self, tokens: Iterable[int] | np.ndarray) -> str:
        ids = [int(t) for t in (tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)]
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"TokenizerFile({str(self.path)!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"
        )


TOKENIZERS: dict[str, type[ByteTokenizer]] = {"byte": ByteTokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    """A tokenizer by name, or a Hugging Face `tokenizers` file by path; anything else is an
    error listing what is accepted."""
    if name in TOKENIZERS:
        return TOKENIZERS[name]()
    if Path(name).expanduser().is_file():
        return TokenizerFile(Path(name).expanduser())
    known = ", ".join(sorted(TOKENIZERS))
    raise ValueError(
        f"unknown tokenizer {name!r}: not a name ({known}) nor an existing tokenizer.json file"
    )
