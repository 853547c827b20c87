"""What both training samplers share: a step counter over epochs, and resuming it exactly.

`TokenBatches` (a token stream cut in windows) and `PackedBatches` (documents packed in rows)
differ only in what one step's rows hold. Both make the global batch of step `s` a function of
(data, layout, seed, s), give data-parallel rank `r` its contiguous slice, and resume from a
`state_dict()` on any dp degree; this base keeps that contract in one place. A subclass sets the
attributes below in its constructor, implements `batch_at(step)` and `_forget_order()` (drop the
cached epoch order when a resumed seed differs), and names the fields that fix its layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from plait.plugins.data.errors import DataError
from plait.plugins.data.token_files import TokenFile


def check_sampling(
    *, seq_len: int, global_batch_size: int, dp_rank: int, dp_size: int, seed: int
) -> None:
    """The arguments every sampler takes, each checked with a message naming it."""
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    if global_batch_size < 1:
        raise DataError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
    if global_batch_size % dp_size:
        raise DataError(
            f"global_batch_size={global_batch_size} is not divisible by "
            f"dp_size={dp_size}: every data-parallel rank must get the same number of "
            "sequences per step"
        )
    if seed < 0:
        raise DataError(f"seed must be >= 0, got {seed}")


class StepSampler:
    """A resumable, endless iterator of one data-parallel rank's batches, step by step."""

    # Fields of `state_dict()` that fix the layout: resuming with other values would silently
    # read other rows, so `load_state_dict` refuses.
    layout_fields: ClassVar[tuple[str, ...]] = ("seq_len", "global_batch_size", "num_windows")

    token_file: TokenFile
    seq_len: int
    global_batch_size: int
    local_batch_size: int
    dp_rank: int
    dp_size: int
    seed: int
    num_windows: int  # rows (windows) per epoch
    steps_per_epoch: int
    _step: int

    def batch_at(self, step: int, *, dp_rank: int | None = None) -> Any:
        """This rank's batch for `step`, without moving the sampler; `dp_rank` reads another
        rank's slice of the same global batch instead (a missing replica group's share, which a
        survivor trains on when the job keeps its global batch)."""
        raise NotImplementedError

    def _slice_rank(self, dp_rank: int | None) -> int:
        """The data-parallel rank whose slice to read: this one's unless `dp_rank` names another."""
        if dp_rank is None:
            return self.dp_rank
        if not 0 <= dp_rank < self.dp_size:
            raise DataError(f"dp_rank must be in [0, dp_size={self.dp_size}), got {dp_rank}")
        return dp_rank

    def _forget_order(self) -> None:
        """Drop any cached epoch order (the seed changed)."""
        raise NotImplementedError

    @property
    def step(self) -> int:
        """Steps consumed so far (the index of the step `next_batch` returns next)."""
        return self._step

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._step // self.steps_per_epoch

    @property
    def tokens_per_step(self) -> int:
        """Input tokens of one global batch, all ranks together (padding included)."""
        return self.global_batch_size * self.seq_len

    @property
    def vocab_size(self) -> int:
        return self.token_file.vocab_size

    def next_batch(self) -> Any:
        """This rank's batch for the current step, then advance one step."""
        batch = self.batch_at(self._step)
        self._step += 1
        return batch

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from; independent of dp, so it resumes on any dp degree."""
        state: dict[str, Any] = {"step": self._step, "epoch": self.epoch, "seed": self.seed}
        state.update({field: getattr(self, field) for field in self.layout_fields})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was saved: the next batches are the same.

        The saved seed wins over the constructor's, since resuming means continuing that run's
        data order. The layout fields must match.
        """
        missing = [key for key in ("step", "seed", *self.layout_fields) if key not in state]
        if missing:
            raise DataError(
                f"{type(self).__name__} state is missing {missing}; got keys {sorted(state)}"
            )
        for key in self.layout_fields:
            saved, mine = state[key], getattr(self, key)
            if (str(saved) if isinstance(mine, str) else int(saved)) != mine:
                raise DataError(
                    f"sampler state was saved with {key}={saved!r}, but this sampler has "
                    f"{key}={mine!r}; resuming would read different data"
                )
        step, seed = int(state["step"]), int(state["seed"])
        if step < 0 or seed < 0:
            raise DataError(f"sampler state has negative step={step} or seed={seed}")
        if "epoch" in state and int(state["epoch"]) != step // self.steps_per_epoch:
            raise DataError(
                f"sampler state is inconsistent: epoch={int(state['epoch'])} but step={step} is "
                f"in epoch {step // self.steps_per_epoch} ({self.steps_per_epoch} steps/epoch)"
            )
        if seed != self.seed:
            self.seed = seed
            self._forget_order()
        self._step = step
