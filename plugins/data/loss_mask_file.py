"""`loss_mask.bin`: which tokens of a prepared token directory are trained on.

The file is one flat uint8 array beside `tokens.bin`, one entry per token: 1 where the model is
trained to predict that token, 0 where it is only context (a chat's system and user turns, the
template's headers). `meta.json` records how many tokens are trained (`trained_tokens`) and the
file's SHA-256; a directory that has the file is format version 3, so a plait that reads only
versions 1 and 2 refuses it rather than silently training on every token.

The mask is read where rows are filled (`packing.fill_rows`): a target whose token is not
trained becomes `IGNORE_INDEX`, so every loss that reads the batch's targets ignores it. A
directory without the file trains on every token, as before.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from plait.plugins.data.errors import TokenFileError

LOSS_MASK_FILE = "loss_mask.bin"
MASK_DTYPE = np.dtype("u1")


def read_loss_mask(path: Path, *, token_count: int, trained_tokens: int) -> np.ndarray:
    """Memory-map `loss_mask.bin` and check it has one 0/1 entry per token. Counting the trained
    tokens reads the file once; it catches a mask written for other tokens."""
    if not path.is_file():
        raise TokenFileError(
            f"{path}: missing (its meta.json records {trained_tokens:,} trained tokens)"
        )
    actual = path.stat().st_size
    if actual != token_count * MASK_DTYPE.itemsize:
        raise TokenFileError(
            f"{path}: {actual:,} bytes on disk, but meta.json records {token_count:,} tokens, "
            "one mask byte each; prepare the token files again"
        )
    # NOTE: np.memmap refuses zero-length files.
    mask = (
        np.memmap(path, dtype=MASK_DTYPE, mode="r", shape=(token_count,))
        if token_count
        else np.empty(0, dtype=MASK_DTYPE)
    )
    counted = int(np.count_nonzero(mask))
    if counted != trained_tokens or (token_count and int(mask.max()) > 1):
        raise TokenFileError(
            f"{path}: holds {counted:,} trained tokens (values other than 0 and 1: "
            f"{bool(token_count and int(mask.max()) > 1)}), but meta.json records "
            f"{trained_tokens:,}; prepare the token files again"
        )
    return mask
