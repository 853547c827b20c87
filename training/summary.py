"""What a training run reports when it ends: losses, validation losses, throughput and memory,
for this attempt and, from the run records, for the whole run across restarts."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plait.daemon.mfu import format_mfu, mfu

if TYPE_CHECKING:
    from rich.console import Console

    from plait.core.engine import Engine
    from plait.plugins.checkpoint.background import SaveTiming
    from plait.training.run_records import EarlierSteps
    from plait.training.steps import RanStep

# The summary's loss is the mean of this many last steps: one step's loss is too noisy to
# compare.
SUMMARY_WINDOW = 10


@dataclass
class TrainingSummary:
    losses: list[float] = field(default_factory=list)  # this attempt's steps
    val_losses: dict[int, float] = field(default_factory=dict)  # step (1-based) -> held-out loss
    stopped: str = ""  # why training ended before train.steps (a signal), or ""
    tokens_per_second: float = 0.0  # this attempt
    mfu: float = 0.0
    memory: dict[str, int] = field(default_factory=dict)
    first_step: int = 0  # steps done before this attempt (a resume)
    # The whole run across restarts, from the run records (this attempt only without them).
    run_steps: int = 0
    run_tokens: int = 0
    run_seconds: float = 0.0
    # This attempt's tokens and the steps' own time (as metrics.jsonl records it: no
    # validation, no saves).
    tokens: int = 0
    step_seconds: float = 0.0
    # The checkpoints this attempt published, with what each cost.
    saves: list[SaveTiming] = field(default_factory=list)

    def record(self, ran: RanStep, val_loss: float | None) -> None:
        self.losses.append(ran.loss)
        self.tokens += ran.report.tokens
        self.step_seconds += ran.report.step_seconds
        if val_loss is not None:
            self.val_losses[ran.step + 1] = val_loss

    def finish(self, engine: Engine, *, elapsed: float, peak: float, earlier: EarlierSteps) -> None:
        """Fill in this attempt's throughput and memory and the whole run's totals."""
        self.tokens_per_second = self.tokens / elapsed
        self.mfu = mfu(engine.flops_per_token * self.tokens_per_second, peak)
        self.memory = engine.memory_report()
        self.run_steps = earlier.steps + len(self.losses)
        self.run_tokens = earlier.tokens + self.tokens
        self.run_seconds = earlier.seconds + self.step_seconds


def clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def mean_loss_line(summary: TrainingSummary) -> str:
    """`loss A → B` where A and B are the means of the first and last few steps of the attempt."""
    losses = summary.losses
    if not losses:
        return "no step ran"
    # Two disjoint windows: the first and last SUMMARY_WINDOW steps, or halves of a short run.
    window = max(1, min(SUMMARY_WINDOW, len(losses) // 2))
    first_step = summary.first_step + 1
    last_step = summary.first_step + len(losses)
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    if window == 1:
        return f"loss {first:.4f} → {last:.4f} (steps {first_step} → {last_step})"
    return (
        f"loss {first:.4f} → {last:.4f} (mean of steps {first_step}–{first_step + window - 1} "
        f"→ {last_step - window + 1}–{last_step})"
    )


def saves_line(saves: list[SaveTiming]) -> str:
    """`N saved · steps blocked X s in all · written in Y s (in the background)`."""
    blocked = sum(s.blocked_s for s in saves)
    written = sum(s.write_s for s in saves)
    background = sum(s.asynchronous for s in saves)
    where = f", {background} in the background" if background else ""
    return (
        f"{len(saves)} saved (last at step {saves[-1].step}) · the steps waited {blocked:.2f} s "
        f"in all · written in {written:.2f} s{where}"
    )


def print_summary(console: Console, summary: TrainingSummary) -> None:
    line = f"[bold]done[/bold]: {mean_loss_line(summary)}"
    if summary.val_losses:
        step, val = max(summary.val_losses.items())
        line += f" · validation loss {val:.4f} at step {step}"
    console.print(line, highlight=False, soft_wrap=True)
    attempt = (
        f"{len(summary.losses)} steps at {summary.tokens_per_second:,.0f} tok/s · "
        f"MFU {format_mfu(summary.mfu)}"
    )
    if summary.run_steps > len(summary.losses):
        run_rate = summary.run_tokens / summary.run_seconds if summary.run_seconds else 0.0
        attempt += (
            f" · whole run ({summary.run_steps} steps across restarts): {run_rate:,.0f} tok/s "
            f"over {clock(summary.run_seconds)} of step time"
        )
    console.print(f"throughput: {attempt}", highlight=False, soft_wrap=True)
    if summary.saves:
        console.print(f"checkpoints: {saves_line(summary.saves)}", highlight=False, soft_wrap=True)
    mem = summary.memory
    console.print(
        "memory (rank 0): "
        + " · ".join(f"{k.replace('_', ' ')} {v / 2**20:,.2f} MiB" for k, v in mem.items()),
        highlight=False,
        soft_wrap=True,
    )
