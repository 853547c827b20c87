"""What rank 0 shows while it trains: the banner, a live progress bar in a terminal or a log line
every `train.log_every` steps elsewhere, validation losses, and the summary at the end. Every
other rank shows nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from plait.core.step import StepReport
from plait.daemon.mfu import format_mfu, mfu
from plait.daemon.peak_flops import PeakFlops
from plait.training.summary import TrainingSummary, clock, print_summary

if TYPE_CHECKING:
    from rich.console import Console

    from plait.core.engine import Engine
    from plait.plugins.data.step_sampler import StepSampler
    from plait.training.steps import RanStep


def rank_peak(engine: Engine) -> PeakFlops:
    """This rank's peak for the job's compute dtype: the same figure the daemon divides by."""
    from plait.daemon.telemetry_resource import peak_flops_for_job

    return peak_flops_for_job(engine.job_info())


class TrainingProgress:
    """Rank 0's view of the run (`leader`); on other ranks every method does nothing."""

    def __init__(self, engine: Engine, console: Console, *, start_step: int) -> None:
        self.engine = engine
        self.console = console
        self.leader = engine.mesh.rank == 0
        self.start_step = start_step
        self.total = engine.config.train.steps
        self.log_every = engine.config.train.log_every
        self.rank_peak = rank_peak(engine) if self.leader else PeakFlops(0.0, "")
        # Every rank of a job runs on the same kind of device, so the job's peak is W × the
        # rank's.
        self.peak = self.rank_peak.flops * engine.mesh.world_size
        self.live = self.leader and console.is_terminal
        self._bar = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            disable=not self.live,
            transient=False,
        )
        self._task = None
        self._started = time.perf_counter()

    def banner(self, batches: StepSampler) -> None:
        if not self.leader:
            return
        from plait.training.banner import run_lines

        for line in run_lines(self.engine, self.rank_peak, batches):
            # Paths, model names and config values: plain text.
            self.console.print(line, highlight=False, soft_wrap=True, markup=False)

    @contextmanager
    def running(self) -> Iterator[TrainingProgress]:
        """The progress bar (live in a terminal) for the steps this attempt runs."""
        self._started = time.perf_counter()
        with self._bar:
            self._task = self._bar.add_task(
                "train", total=self.total, completed=self.start_step, stats=""
            )
            yield self

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def step(self, ran: RanStep, *, val_loss: float | None) -> None:
        if not self.leader:
            return
        steps_done = ran.step + 1
        stats = format_stats(ran.report, self.peak)
        if self._task is not None:
            self._bar.update(self._task, completed=steps_done, stats=stats)
        if not self.live and (
            steps_done % self.log_every == 0
            or steps_done == self.total
            or ran.step == self.start_step
        ):
            elapsed = self.elapsed
            eta = elapsed / (steps_done - self.start_step) * (self.total - steps_done)
            self.console.print(
                f"step {steps_done}/{self.total} {stats} | elapsed "
                f"{clock(elapsed)} eta {clock(eta)}",
                highlight=False,
                soft_wrap=True,
            )
        if val_loss is not None:
            self.console.print(
                f"step {steps_done}/{self.total} validation loss {val_loss:.4f}",
                highlight=False,
                soft_wrap=True,
            )

    def summary(self, summary: TrainingSummary) -> None:
        if self.leader:
            print_summary(self.console, summary)


def format_stats(report: StepReport, peak: float) -> str:
    tokens_per_second = report.tokens / report.step_seconds if report.step_seconds else 0.0
    flops_per_second = report.model_flops / report.step_seconds if report.step_seconds else 0.0
    utilisation = format_mfu(mfu(flops_per_second, peak))
    stats = (
        f"loss {report.loss:.4f} | {tokens_per_second:,.0f} tok/s | MFU {utilisation} | "
        f"lr {report.lr:.2e} | {report.step_seconds * 1e3:.0f} ms"
    )
    bubble = next(
        (
            s.attributes["bubble_fraction"]
            for s in report.spans
            if "bubble_fraction" in s.attributes
        ),
        None,
    )
    if bubble is not None:
        stats += f" | bubble {bubble:.0%}"
    if report.skipped:
        stats += " | step skipped"
    return stats
