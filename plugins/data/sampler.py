"""The stream sampler: deterministic, data-parallel-rank-aware and resumable batches of tokens.

It reads a token directory without document offsets (format version 1, the bundled corpus);
`build_batches` picks it, or `PackedBatches` (`packed_sampler.py`) for a directory of documents.

The token stream is cut into non-overlapping windows: window `w` starts at token `w · seq_len`
and holds `seq_len + 1` tokens, the first `seq_len` being the inputs and the last `seq_len` the
next-token targets (consecutive windows share one boundary token, as in nanoGPT and Megatron's
GPT dataset). Each epoch visits every window in the order of a permutation seeded by
`(seed, epoch)`; step `s` of an epoch takes the permutation's entries `[s·G, (s+1)·G)` as the
job's global batch of `G` sequences, and data-parallel rank `r` of `dp` takes the contiguous
slice `[r·G/dp, (r+1)·G/dp)` of it. So the global batch of every step is a function of
(data, seq_len, G, seed, step) only — the same for any dp degree — which is what makes a dp=2 run
match a single-process run step for step and lets a checkpoint resume on a different dp degree.
Windows left over after the last whole global batch of an epoch are skipped in that epoch; the
next epoch's shuffle gives them their turn.

Tensor-, pipeline- and context-parallel ranks of one data-parallel replica pass the same
`dp_rank` and therefore read the same batch.

A held-out split (`build_batches(..., holdout=f)`) keeps the last `f` of the windows for
validation: the training sampler sees only the windows before them, the validation sampler only
those (a contiguous tail of the token stream, so no validation window is also a training one).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from plait.plugins.data.documents_file import DOCUMENTS_FILE
from plait.plugins.data.loss_mask_file import LOSS_MASK_FILE
from plait.plugins.data.step_sampler import StepSampler, check_sampling
from plait.plugins.data.token_files import DataError, TokenFile

if TYPE_CHECKING:
    from plait.core.config import DataSection
    from plait.plugins.data.packed_sampler import PackedBatches

Batch = tuple[torch.Tensor, torch.Tensor]


class TokenBatches(StepSampler):
    """An endless iterator of `(inputs, targets)` int64 tensors of shape `[G/dp, seq_len]`."""

    def __init__(
        self,
        token_file: TokenFile | Path | str,
        *,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        windows: tuple[int, int] | None = None,
    ) -> None:
        """`windows = (first, count)` restricts sampling to those windows of the file (a split);
        `None` = every window."""
        check_sampling(
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
        )
        self.token_file = token_file if isinstance(token_file, TokenFile) else TokenFile(token_file)
        if self.token_file.loss_mask is not None:
            # Windows cut across documents and read no mask: refused rather than trained on
            # every token (a masked directory always has documents; this is a misuse).
            raise DataError(
                f"{self.token_file.directory} has a loss mask ({LOSS_MASK_FILE}), which "
                "TokenBatches cannot honour: read it with PackedBatches (build_batches does)"
            )
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.local_batch_size = global_batch_size // dp_size
        count = self.token_file.count
        file_windows = (count - 1) // seq_len if count > 1 else 0
        first, num = windows if windows is not None else (0, file_windows)
        if first < 0 or num < 0 or first + num > file_windows:
            raise DataError(
                f"windows ({first}, {num}) are outside the file's {file_windows:,} windows"
            )
        self.first_window = first
        self.num_windows = num
        if self.num_windows < global_batch_size:
            held = "" if windows is None else f" in this split ({num:,} of {file_windows:,})"
            raise DataError(
                f"{self.token_file.directory} holds {count:,} tokens = {file_windows:,} "
                f"windows of seq_len+1 = {seq_len + 1} tokens, {self.num_windows:,}{held}: "
                f"fewer than one global batch of {global_batch_size} sequences; use more data, "
                "a shorter seq_len or a smaller global batch"
                + (" (or a larger train.eval_fraction)" if windows is not None and first else "")
            )
        self.steps_per_epoch = self.num_windows // global_batch_size
        self._tokens = self.token_file.tokens
        self._step = 0
        self._permutation_epoch = -1
        self._permutation: np.ndarray = np.empty(0, dtype=np.uint32)

    # ---------------------------------------------------------------------------------------
    # sampling
    # ---------------------------------------------------------------------------------------

    def window_order(self, epoch: int) -> np.ndarray:
        """The order in which `epoch` visits the windows (a permutation of window indices)."""
        if epoch != self._permutation_epoch:
            # NOTE: (seed, epoch) goes through SeedSequence, so seed 1 / epoch 1 and seed 2 /
            # epoch 0 give unrelated orders (a plain `seed + epoch` would make them equal).
            generator = np.random.Generator(np.random.PCG64((self.seed, epoch)))
            # Shuffling uint32 indices in place gives the same order as `permutation()` with
            # half its memory, which matters once a corpus has hundreds of millions of windows.
            index_dtype = np.uint32 if self.num_windows <= np.iinfo(np.uint32).max else np.int64
            order = np.arange(self.num_windows, dtype=index_dtype)
            generator.shuffle(order)
            self._permutation = order
            self._permutation_epoch = epoch
        return self._permutation

    def global_window_indices(self, step: int) -> np.ndarray:
        """Indices of the windows in the whole job's batch at `step`, in rank order."""
        epoch, index_in_epoch = divmod(step, self.steps_per_epoch)
        start = index_in_epoch * self.global_batch_size
        return self.window_order(epoch)[start : start + self.global_batch_size]

    def local_window_indices(self, step: int, *, dp_rank: int | None = None) -> np.ndarray:
        """Indices of this rank's windows at `step`: its contiguous slice of the global batch
        (`dp_rank`: another rank's)."""
        first = self._slice_rank(dp_rank) * self.local_batch_size
        return self.global_window_indices(step)[first : first + self.local_batch_size]

    def batch_at(self, step: int, *, dp_rank: int | None = None) -> Batch:
        """This rank's `(inputs, targets)` for `step`, without moving the sampler (`dp_rank`:
        another rank's slice of the step's global batch)."""
        if step < 0:
            raise DataError(f"step must be >= 0, got {step}")
        span = self.seq_len + 1
        # Rows are gathered as contiguous memmap slices (one sequential read each) into one
        # int64 buffer holding inputs and targets, so a batch costs one allocation and one
        # torch.from_numpy, and both halves come out contiguous.
        buffer = np.empty((2, self.local_batch_size, self.seq_len), dtype=np.int64)
        for row, window in enumerate(self.local_window_indices(step, dp_rank=dp_rank)):
            start = (self.first_window + int(window)) * self.seq_len
            tokens = self._tokens[start : start + span]
            buffer[0, row] = tokens[:-1]
            buffer[1, row] = tokens[1:]
        inputs, targets = torch.from_numpy(buffer).unbind(0)
        return inputs, targets

    def _forget_order(self) -> None:
        self._permutation_epoch = -1

    def __repr__(self) -> str:
        return (
            f"TokenBatches({str(self.token_file.directory)!r}, seq_len={self.seq_len}, "
            f"global_batch_size={self.global_batch_size}, dp_rank={self.dp_rank}, "
            f"dp_size={self.dp_size}, seed={self.seed}, step={self._step})"
        )


def build_batches(
    data_config: DataSection,
    *,
    seq_len: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    cache_dir: Path | str | None = None,
    holdout: float = 0.0,
    split: Literal["train", "validation"] = "train",
) -> TokenBatches | PackedBatches:
    """The sampler a config's `[data]` section describes; `path = ''` is the bundled corpus.

    A directory with document offsets gets `PackedBatches` with `data.packing` and
    `data.document_mask` (`packing = "none"`: one document per row, padded); a stream (format
    version 1, or the bundled corpus) gets `TokenBatches`, where only the default packing is
    accepted. `holdout` (a fraction in [0, 1)) keeps the last windows (of a stream) or documents
    for validation; `split` picks the training part or the held-out one. `holdout = 0` is
    everything, for training only.
    """
    if data_config.path:
        directory = Path(data_config.path).expanduser()
    else:
        from plait.plugins.data.corpus import bundled_corpus_dir

        directory = bundled_corpus_dir(cache_dir)
    token_file = TokenFile(directory)
    if not holdout and split != "train":
        raise DataError("a validation split needs holdout > 0 (train.eval_fraction)")
    if token_file.documents is not None:
        from plait.plugins.data.packed_sampler import PackedBatches, split_documents

        documents = split_documents(token_file.documents.count, holdout)[split] if holdout else None
        return PackedBatches(
            token_file,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            packing=data_config.packing,
            document_mask=data_config.document_mask,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
            documents=documents,
        )
    if "packing" in data_config.model_fields_set and data_config.packing != "concat_split":
        raise DataError(
            f"data.packing = {data_config.packing!r} needs document offsets, but "
            f"{token_file.directory} is one token stream (format version "
            f"{token_file.meta.format_version}, no {DOCUMENTS_FILE}); prepare it again with "
            "`plait data prepare`, or leave data.packing unset"
        )
    windows = split_windows(token_file.count, seq_len, holdout)[split] if holdout else None
    return TokenBatches(
        token_file,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        windows=windows,
    )


def split_windows(token_count: int, seq_len: int, holdout: float) -> dict[str, tuple[int, int]]:
    """`(first window, count)` of the training and validation splits of a token stream."""
    if not 0 < holdout < 1:
        raise DataError(f"the held-out fraction must be in (0, 1), got {holdout}")
    total = (token_count - 1) // seq_len if token_count > 1 else 0
    held = max(1, round(total * holdout)) if total > 1 else 0
    # The last training window's final target is the first validation window's first input: one
    # shared boundary token, as between any two consecutive windows.
    return {"train": (0, total - held), "validation": (total - held, held)}
