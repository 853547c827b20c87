"""Training data: byte tokenizer, memory-mapped token files, the bundled corpus and the sampler.

    from plait.plugins.data import build_batches
    batches = build_batches(config.data, seq_len=128, global_batch_size=8,
                            dp_rank=mesh.dp_rank, dp_size=mesh.dp_size, seed=config.train.seed)
    inputs, targets = batches.next_batch()   # LongTensor[G/dp, seq_len] each

This package implements no hook: it is a library the engine calls, kept under `plugins/` so a
project with its own data pipeline can ignore it entirely.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.plugins.data.corpus import bundled_corpus_dir, bundled_corpus_file
    from plait.plugins.data.sampler import Batch, TokenBatches, build_batches
    from plait.plugins.data.token_files import (
        DataError,
        TokenFile,
        TokenFileError,
        TokenFileMeta,
        prepare_token_files,
    )
    from plait.plugins.data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer, token_dtype

# Resolved on first use so `plait data prepare` and `plait --help` do not import torch.
_EXPORTS = {
    "Batch": "sampler",
    "ByteTokenizer": "tokenizer",
    "DataError": "token_files",
    "TokenBatches": "sampler",
    "TokenFile": "token_files",
    "TokenFileError": "token_files",
    "TokenFileMeta": "token_files",
    "Tokenizer": "tokenizer",
    "build_batches": "sampler",
    "bundled_corpus_dir": "corpus",
    "bundled_corpus_file": "corpus",
    "get_tokenizer": "tokenizer",
    "prepare_token_files": "token_files",
    "token_dtype": "tokenizer",
}
__all__ = [
    "Batch",
    "ByteTokenizer",
    "DataError",
    "TokenBatches",
    "TokenFile",
    "TokenFileError",
    "TokenFileMeta",
    "Tokenizer",
    "build_batches",
    "bundled_corpus_dir",
    "bundled_corpus_file",
    "get_tokenizer",
    "prepare_token_files",
    "token_dtype",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
