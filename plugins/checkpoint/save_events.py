"""What a checkpoint save tells the daemon: that it started, then how it ended and what it cost.

The job's rank 0 — one per job is enough: every rank writes its part of the same checkpoint at
the same step, and rank 0 publishes it — puts a `CheckpointSaveSpan` on the core's span board
when a save starts (an instant, outcome "started") and another when its write ends (saved or
failed, timed over the write's own time, with what the training step waited and the bytes
written). The telemetry plugin sends each as a `plait.checkpoint.save` span, so `plait status`
shows a save being written and the last one's cost (`plait.daemon.checkpoint_log`). Neither
plugin imports the other; with the telemetry off nobody takes them and they fall off the board.

    publish_save(CheckpointSaveSpan.started(step=45, asynchronous=True))
    ...                                              # the write, in the background
    publish_save(CheckpointSaveSpan.ended(step=45, asynchronous=True, write_s=1.8, ...))
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from plait.core.span_board import BOARD, PublishedSpan, SpanBoard
from plait.daemon import telemetry_schema as names

MAX_ERROR_CHARS = 300


def first_line(error: str) -> str:
    """The first line of an error's text, shortened: what the daemon shows of a failed save."""
    line = error.strip().split("\n", 1)[0]
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSaveSpan:
    """One save's start or end, as the telemetry sends it (times: Unix nanoseconds).

    `blocked_s`: what the training step waited for the save (the previous save, the copy to
    host memory when asynchronous, the whole write when not); `write_s`: the write itself,
    publication included; `nbytes`: the files the job wrote (None: unknown)."""

    step: int
    asynchronous: bool
    outcome: str  # one of telemetry_schema.CHECKPOINT_OUTCOMES
    start_ns: int
    end_ns: int
    blocked_s: float = 0.0
    write_s: float = 0.0
    nbytes: int | None = None
    error: str = ""

    @classmethod
    def started(cls, *, step: int, asynchronous: bool) -> CheckpointSaveSpan:
        now = time.time_ns()
        return cls(
            step=step,
            asynchronous=asynchronous,
            outcome=names.CHECKPOINT_STARTED,
            start_ns=now,
            end_ns=now,
        )

    @classmethod
    def ended(
        cls,
        *,
        step: int,
        asynchronous: bool,
        start_ns: int,
        blocked_s: float,
        write_s: float,
        nbytes: int | None,
        error: str = "",
    ) -> CheckpointSaveSpan:
        """A write that ends now: saved, or failed with `error`."""
        return cls(
            step=step,
            asynchronous=asynchronous,
            outcome=names.CHECKPOINT_FAILED if error else names.CHECKPOINT_SAVED,
            start_ns=start_ns,
            end_ns=time.time_ns(),
            blocked_s=blocked_s,
            write_s=write_s,
            nbytes=None if error else nbytes,
            error=error,
        )

    @property
    def always_sent(self) -> bool:
        return True  # a few per job, and what an operator reads the saves from

    def spans(self, step: int) -> list[PublishedSpan]:
        del step  # a save carries its own step
        return [
            PublishedSpan(
                name=names.CHECKPOINT_SAVE_SPAN_NAME,
                start_ns=self.start_ns,
                end_ns=max(self.end_ns, self.start_ns),
                attributes=self.attributes(),
            )
        ]

    def attributes(self) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            names.SPAN_CHECKPOINT_STEP: self.step,
            names.SPAN_CHECKPOINT_ASYNC: self.asynchronous,
            names.SPAN_CHECKPOINT_OUTCOME: self.outcome,
        }
        if self.outcome == names.CHECKPOINT_STARTED:
            return attributes
        attributes[names.SPAN_CHECKPOINT_BLOCKED] = max(self.blocked_s, 0.0)
        attributes[names.SPAN_CHECKPOINT_WRITE] = max(self.write_s, 0.0)
        if self.nbytes is not None:
            attributes[names.SPAN_CHECKPOINT_BYTES] = self.nbytes
        if self.error:
            attributes[names.SPAN_CHECKPOINT_ERROR] = first_line(self.error)
        return attributes


def publish_save(span: CheckpointSaveSpan, *, board: SpanBoard = BOARD) -> None:
    """Publish a save's start or end for the telemetry (rank 0 does; any thread may)."""
    board.publish(span)
