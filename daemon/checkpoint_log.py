"""A job's checkpoint saves as the daemon shows them: the one being written, and the last one.

The job's rank 0 sends a `plait.checkpoint.save` instant when a save starts and one span over the
write when it ends, saved or failed (`plait.plugins.checkpoint.save_events`). The store keeps,
per job, the latest save started and the latest ended (`CheckpointLog`); `checkpoint_figures`
says, at a given time, whether a save is being written and what the last one cost. The gRPC
servicer, the CLI and the page only translate these figures.

    log = CheckpointLog()
    log.add(CheckpointSaveRecord(figures, start_ns, end_ns))   # the store, per span
    figures = checkpoint_figures(log, now_ns=time.time_ns(), running=True)
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.daemon import telemetry_schema as schema
from plait.daemon.decoder import INT64_MAX, CheckpointFigures

# What `CheckpointSaveFigures.outcome` says of a save still being written.
WRITING = "writing"


@dataclass(frozen=True, slots=True)
class CheckpointSaveRecord:
    """One checkpoint span as the daemon keeps it (rank 0's clock)."""

    figures: CheckpointFigures
    start_ns: int
    end_ns: int


@dataclass
class CheckpointLog:
    """One job's latest save started and latest save ended, and how many ended (failed)."""

    started: CheckpointSaveRecord | None = None
    ended: CheckpointSaveRecord | None = None
    saves_ended: int = 0
    saves_failed: int = 0

    def add(self, record: CheckpointSaveRecord) -> None:
        # Spans arrive in batches, a quick save's start and end possibly in one: order by time.
        if record.figures.outcome == schema.CHECKPOINT_STARTED:
            if self.started is None or record.start_ns >= self.started.start_ns:
                self.started = record
            return
        self.saves_ended += 1
        if record.figures.outcome == schema.CHECKPOINT_FAILED:
            self.saves_failed += 1
        if self.ended is None or record.end_ns >= self.ended.end_ns:
            self.ended = record

    @property
    def writing(self) -> CheckpointSaveRecord | None:
        """The save started after the last one ended (None when every save started has ended).

        A save starts only once the previous one has ended (the checkpointer waits for it),
        so a start later than the last end is a save still being written."""
        started, ended = self.started, self.ended
        if started is None or (ended is not None and started.start_ns <= ended.end_ns):
            return None
        return started


@dataclass(frozen=True, slots=True)
class CheckpointSaveFigures:
    """One save as an operator reads it. `age_seconds`: since it ended (since it started while
    it is being written), by the daemon's clock when it answered."""

    step: int
    asynchronous: bool
    outcome: str  # "writing", "saved" or "failed"
    error: str
    start_unix_nano: int
    end_unix_nano: int  # 0 while writing
    write_seconds: float
    blocked_seconds: float
    nbytes: int  # -1: unknown
    age_seconds: float


@dataclass(frozen=True, slots=True)
class JobCheckpointFigures:
    """A job's checkpoints: the last save that ended, the one being written, the counts."""

    last: CheckpointSaveFigures | None
    writing: CheckpointSaveFigures | None
    saves: int  # saves that ended, saved or failed
    failed: int


def _clamped(ns: int) -> int:
    return min(max(ns, 0), INT64_MAX)


def _age(now_ns: int, then_ns: int) -> float:
    return max(now_ns - then_ns, 0) / 1e9


def checkpoint_figures(
    log: CheckpointLog | None, *, now_ns: int, running: bool
) -> JobCheckpointFigures | None:
    """What the daemon shows of a job's checkpoints (None for a job that sent none). A save
    started by a job that is no longer running is not shown as being written."""
    if log is None or (log.started is None and log.ended is None):
        return None
    last = writing = None
    if log.ended is not None:
        ended = log.ended
        f = ended.figures
        last = CheckpointSaveFigures(
            step=f.step,
            asynchronous=f.asynchronous,
            outcome=f.outcome,
            error=f.error,
            start_unix_nano=_clamped(ended.start_ns),
            end_unix_nano=_clamped(ended.end_ns),
            write_seconds=f.write_seconds,
            blocked_seconds=f.blocked_seconds,
            nbytes=f.nbytes,
            age_seconds=_age(now_ns, ended.end_ns),
        )
    started = log.writing
    if started is not None and running:
        f = started.figures
        writing = CheckpointSaveFigures(
            step=f.step,
            asynchronous=f.asynchronous,
            outcome=WRITING,
            error="",
            start_unix_nano=_clamped(started.start_ns),
            end_unix_nano=0,
            write_seconds=0.0,
            blocked_seconds=0.0,
            nbytes=-1,
            age_seconds=_age(now_ns, started.start_ns),
        )
    return JobCheckpointFigures(
        last=last, writing=writing, saves=log.saves_ended, failed=log.saves_failed
    )
