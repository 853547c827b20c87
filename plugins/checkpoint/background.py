"""One checkpoint write running beside training, and the records of what a save cost and why one
failed.

    write = BackgroundWrite(step, temp, lambda: write_checkpoint(staged, temp, step))
    ...                                  # training goes on
    write.join()                         # the next save, close() or a stop waits here
    if write.failure is not None: report(write.failure.describe())

A failed write is kept, not raised in the thread: the training loop learns of it at its next
save or at close, by name, and goes on training (the previous checkpoint is untouched).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from plait.plugins.checkpoint.storage import step_dir_name

THREAD_NAME = "plait-checkpoint-write"

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SaveTiming:
    """What one save cost. `blocked_s` is what the training step waited (the previous save, the
    copy to host memory when asynchronous, the whole write when not); `write_s` is the write
    itself, publication included, wherever it ran."""

    step: int
    asynchronous: bool
    blocked_s: float
    waited_for_previous_s: float
    copy_s: float
    write_s: float

    def describe(self) -> str:
        how = "in the background" if self.asynchronous else "synchronously"
        return (
            f"checkpoint step {self.step} written {how} in {self.write_s:.3f}s; the step was "
            f"blocked {self.blocked_s:.3f}s (copy to host {self.copy_s:.3f}s, waiting for the "
            f"previous save {self.waited_for_previous_s:.3f}s)"
        )


@dataclass(frozen=True, slots=True)
class SaveFailure:
    """A checkpoint that was not published, and why."""

    step: int
    path: Path
    error: str

    def describe(self) -> str:
        return f"checkpoint {step_dir_name(self.step)} was not saved ({self.path}): {self.error}"


def describe_error(error: BaseException) -> str:
    """The error of a write, named: DCP wraps each rank's own in a `CheckpointException`."""
    if isinstance(error, CheckpointException):
        causes = [
            f"rank {rank}: {type(cause).__name__}: {cause}"
            for rank, (cause, _trace) in sorted(error.failures.items())
        ]
        return "; ".join(causes) or str(error)
    return f"{type(error).__name__}: {error}"


class BackgroundWrite:
    """Runs `write` in a thread of its own; records its duration or its failure, then calls
    `on_end` (if given) in that thread, before any `join()` returns."""

    def __init__(
        self,
        step: int,
        path: Path,
        write: Callable[[], None],
        on_end: Callable[[BackgroundWrite], None] | None = None,
    ) -> None:
        self.step = step
        self.path = path
        self._write = write
        self._on_end = on_end
        self.started_ns = 0  # Unix time the write began
        self.write_s: float | None = None
        self.failure: SaveFailure | None = None
        # A daemon thread, so a rank whose peers died cannot hang its interpreter's exit;
        # the checkpointer joins it at close() and at exit otherwise.
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.started_ns = time.time_ns()
        started = time.perf_counter()
        try:
            self._write()
        except BaseException as exc:  # reported by whoever joins
            self.failure = SaveFailure(self.step, self.path, describe_error(exc))
        finally:
            self.write_s = time.perf_counter() - started
        if self._on_end is not None:
            try:
                self._on_end(self)
            except Exception:  # telling of the write must not lose the write's own outcome
                log.exception("reporting checkpoint step %d failed", self.step)

    def join(self) -> None:
        self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()
