"""The packed sampler: deterministic, rank-aware, resumable batches of documents packed in rows.

A token directory with document offsets (`plait data prepare`) is read in rows of `seq_len`
tokens that keep documents apart (`packing.py` lays them out and writes the arrays). Each epoch
shuffles the documents with a generator seeded by `(seed, epoch)` and builds the epoch's
`RowPlan` with the configured packing (`concat_split`, `first_fit` — whose rows are then
shuffled too, or they would run from the longest documents to the shortest — or `none`); the
number of rows is the same every epoch, since only the order changes. Step `s` of an epoch takes
rows `[s·G, (s+1)·G)` of the plan as the job's global batch, and data-parallel rank `r` of `dp`
its contiguous slice `[r·G/dp, (r+1)·G/dp)`: exactly `TokenBatches`' contract, so the global
batch of every step is a function of (data, seq_len, G, seed, step, packing) only, dp=2 slices
concatenate to the dp=1 batch, and a checkpoint resumes on any dp degree. Rows left over after
the last whole global batch of an epoch are skipped in that epoch.

A batch is `(inputs, targets)`:

    inputs = {"tokens": LongTensor[G/dp, seq_len], "positions": LongTensor[G/dp, seq_len]}
    targets = LongTensor[G/dp, seq_len]     # -100 where nothing is scored

(what is scored, and the padding, are described in `packing.py`; padding uses the EOS id). A
directory with a loss mask (`plait data prepare --chat`) scores only its trained tokens, in every
packing and in the held-out split alike, since all of them fill rows through `fill_rows`.

A held-out split keeps the last documents of the directory for validation: the training sampler
packs only the documents before them, the validation sampler only those.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from plait.plugins.data.errors import DataError
from plait.plugins.data.packing import PLANNERS, RowPlan, fill_rows
from plait.plugins.data.step_sampler import StepSampler, check_sampling
from plait.plugins.data.token_files import TokenFile

Packing = Literal["concat_split", "first_fit", "none"]
PackedBatch = tuple[dict[str, torch.Tensor], torch.Tensor]


class PackedBatches(StepSampler):
    """An endless iterator of packed `(inputs, targets)` batches of `G/dp` rows."""

    layout_fields = ("seq_len", "global_batch_size", "num_windows", "packing", "num_documents")

    def __init__(
        self,
        token_file: TokenFile,
        *,
        seq_len: int,
        global_batch_size: int,
        packing: Packing = "concat_split",
        document_mask: bool = True,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        documents: tuple[int, int] | None = None,
    ) -> None:
        """`documents = (first, count)` restricts sampling to those documents (a split);
        `None` = every document."""
        if token_file.documents is None:
            raise DataError(
                f"{token_file.directory} has no document offsets (a stream); it is read by "
                "TokenBatches"
            )
        if packing not in PLANNERS:
            raise DataError(f"packing must be one of {sorted(PLANNERS)}, got {packing!r}")
        check_sampling(
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=seed,
        )
        index = token_file.documents
        first, count = documents if documents is not None else (0, index.count)
        if first < 0 or count < 1 or first + count > index.count:
            raise DataError(
                f"documents ({first}, {count}) are outside the file's {index.count:,} documents"
            )
        self.token_file = token_file
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.packing = packing
        self.document_mask = document_mask
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.local_batch_size = global_batch_size // dp_size
        self.first_document = first
        self.num_documents = count
        self._starts = np.asarray(index.starts[first : first + count])
        self._lengths = np.asarray(index.lengths[first : first + count])
        eos = token_file.meta.eos_id
        self.pad_id = eos if eos is not None else 0
        self._tokens = token_file.tokens
        self._loss_mask = token_file.loss_mask
        self._step = 0
        self._plan_epoch = -1
        self._plan = self.row_plan(0)
        self.num_windows = self._plan.rows  # rows per epoch; the stream sampler's name
        if self.num_windows < global_batch_size:
            held = "" if documents is None else f" ({count:,} of {index.count:,} documents)"
            raise DataError(
                f"{token_file.directory}{held} packs into {self.num_windows:,} rows of "
                f"seq_len = {seq_len} tokens with packing {packing!r}: fewer than one global "
                f"batch of {global_batch_size} rows; use more data, a shorter seq_len or a "
                "smaller global batch"
            )
        self.steps_per_epoch = self.num_windows // global_batch_size

    # ---------------------------------------------------------------------------------------
    # sizes
    # ---------------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        """Rows of `seq_len` tokens per epoch."""
        return self.num_windows

    @property
    def padding_fraction(self) -> float:
        """Share of an epoch's row tokens that are padding (the same every epoch)."""
        return self._plan.padding_fraction

    # ---------------------------------------------------------------------------------------
    # sampling
    # ---------------------------------------------------------------------------------------

    def row_plan(self, epoch: int) -> RowPlan:
        """The rows of `epoch`, in the order its steps take them (cached for one epoch)."""
        if epoch != self._plan_epoch:
            # NOTE: (seed, epoch) goes through SeedSequence, as in TokenBatches.
            generator = np.random.Generator(np.random.PCG64((self.seed, epoch)))
            order = np.arange(self.num_documents, dtype=np.int64)
            generator.shuffle(order)
            plan = PLANNERS[self.packing](self._starts[order], self._lengths[order], self.seq_len)
            if self.packing == "first_fit":
                rows = np.arange(plan.rows, dtype=np.int64)
                generator.shuffle(rows)
                plan = plan.take_rows(rows)
            if self._plan_epoch >= 0 and plan.rows != self._plan.rows:
                raise AssertionError(f"epoch {epoch} packs {plan.rows} rows, not {self._plan.rows}")
            self._plan, self._plan_epoch = plan, epoch
        return self._plan

    def global_rows(self, step: int) -> np.ndarray:
        """Indices, in its epoch's plan, of the rows of the whole job's batch at `step`."""
        index_in_epoch = step % self.steps_per_epoch
        start = index_in_epoch * self.global_batch_size
        return np.arange(start, start + self.global_batch_size, dtype=np.int64)

    def local_rows(self, step: int, *, dp_rank: int | None = None) -> np.ndarray:
        """This rank's rows at `step`: its contiguous slice of the global batch (`dp_rank`:
        another rank's)."""
        first = self._slice_rank(dp_rank) * self.local_batch_size
        return self.global_rows(step)[first : first + self.local_batch_size]

    def local_plan(self, step: int, *, dp_rank: int | None = None) -> RowPlan:
        """The plan of this rank's rows at `step` (`dp_rank`: another rank's)."""
        if step < 0:
            raise DataError(f"step must be >= 0, got {step}")
        rows = self.local_rows(step, dp_rank=dp_rank)
        return self.row_plan(step // self.steps_per_epoch).take_rows(rows)

    def batch_at(self, step: int, *, dp_rank: int | None = None) -> PackedBatch:
        """This rank's `(inputs, targets)` for `step`, without moving the sampler (`dp_rank`:
        another rank's slice of the step's global batch)."""
        tokens, positions, targets = fill_rows(
            self.local_plan(step, dp_rank=dp_rank),
            self._tokens,
            pad_id=self.pad_id,
            document_mask=self.document_mask,
            loss_mask=self._loss_mask,
        )
        inputs = {"tokens": torch.from_numpy(tokens), "positions": torch.from_numpy(positions)}
        return inputs, torch.from_numpy(targets)

    def _forget_order(self) -> None:
        self._plan_epoch = -1

    def __repr__(self) -> str:
        return (
            f"PackedBatches({str(self.token_file.directory)!r}, packing={self.packing!r}, "
            f"seq_len={self.seq_len}, global_batch_size={self.global_batch_size}, "
            f"dp_rank={self.dp_rank}, dp_size={self.dp_size}, seed={self.seed}, "
            f"step={self._step})"
        )


def split_documents(num_documents: int, holdout: float) -> dict[str, tuple[int, int]]:
    """`(first document, count)` of the training and validation splits: the last `holdout` of
    the documents (at least one) are held out."""
    if not 0 < holdout < 1:
        raise DataError(f"the held-out fraction must be in (0, 1), got {holdout}")
    if num_documents < 2:
        raise DataError(
            f"a held-out split needs at least 2 documents, the data has {num_documents}"
        )
    held = min(num_documents - 1, max(1, round(num_documents * holdout)))
    return {"train": (0, num_documents - held), "validation": (num_documents - held, held)}
