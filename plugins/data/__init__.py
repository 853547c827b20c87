"""Training data: tokenizers, corpus readers, memory-mapped token files, the bundled corpus, and
the samplers (a token stream cut into windows, or documents packed into rows).

    from plait.plugins.data import build_batches, prepare_documents
    prepare_documents(["corpus.jsonl.gz"], "tokens/", workers=4)    # plait data prepare
    prepare_conversations(["chats.jsonl"], "chat-tokens/",          # plait data prepare --chat
                          tokenizer=load_chat_tokenizer("tokenizer-dir/"))
    batches = build_batches(config.data, seq_len=128, global_batch_size=8,
                            dp_rank=mesh.dp_rank, dp_size=mesh.dp_size, seed=config.train.seed)
    inputs, targets = batches.next_batch()
    # documents: inputs = {"tokens": LongTensor[G/dp, seq_len], "positions": …}, targets -100
    # where nothing is scored (nor, with a loss mask, any token not trained on); a stream
    # (bundled corpus): inputs = LongTensor[G/dp, seq_len]

This package implements no hook: it is a library the engine calls, kept under `plugins/` so a
project with its own data pipeline can ignore it entirely.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.plugins.data.chat_preparation import prepare_conversations
    from plait.plugins.data.chat_template import ChatTokenizer, load_chat_tokenizer
    from plait.plugins.data.corpus import bundled_corpus_dir, bundled_corpus_file
    from plait.plugins.data.corpus_preparation import PrepareReport, prepare_documents
    from plait.plugins.data.errors import DataError, TokenFileError
    from plait.plugins.data.packed_sampler import PackedBatch, PackedBatches
    from plait.plugins.data.sampler import Batch, TokenBatches, build_batches
    from plait.plugins.data.token_files import TokenFile, TokenFileMeta, prepare_token_files
    from plait.plugins.data.tokenizer import ByteTokenizer, Tokenizer, get_tokenizer, token_dtype

# Resolved on first use so `plait data prepare` and `plait --help` do not import torch.
_EXPORTS = {
    "Batch": "sampler",
    "ByteTokenizer": "tokenizer",
    "ChatTokenizer": "chat_template",
    "DataError": "errors",
    "PackedBatch": "packed_sampler",
    "PackedBatches": "packed_sampler",
    "PrepareReport": "corpus_preparation",
    "TokenBatches": "sampler",
    "TokenFile": "token_files",
    "TokenFileError": "errors",
    "TokenFileMeta": "token_files",
    "Tokenizer": "tokenizer",
    "build_batches": "sampler",
    "bundled_corpus_dir": "corpus",
    "bundled_corpus_file": "corpus",
    "get_tokenizer": "tokenizer",
    "load_chat_tokenizer": "chat_template",
    "prepare_conversations": "chat_preparation",
    "prepare_documents": "corpus_preparation",
    "prepare_token_files": "token_files",
    "token_dtype": "tokenizer",
}
__all__ = [
    "Batch",
    "ByteTokenizer",
    "ChatTokenizer",
    "DataError",
    "PackedBatch",
    "PackedBatches",
    "PrepareReport",
    "TokenBatches",
    "TokenFile",
    "TokenFileError",
    "TokenFileMeta",
    "Tokenizer",
    "build_batches",
    "bundled_corpus_dir",
    "bundled_corpus_file",
    "get_tokenizer",
    "load_chat_tokenizer",
    "prepare_conversations",
    "prepare_documents",
    "prepare_token_files",
    "token_dtype",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
