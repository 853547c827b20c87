"""The per-rank training loop behind `plait train`: engine, data, progress bar, summary.

Launched by torchrun (`python -m plait.tools.trainer CONFIG [--set k=v ...]`); also callable
in-process (`run_training(config)`) for tests and a single process.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from plait.core.config import PlaitConfig, load_config
from plait.core.engine import Engine
from plait.core.errors import ConfigError, PlaitError
from plait.core.mfu import format_mfu, mfu
from plait.core.peak_flops import PeakFlops
from plait.core.step import StepReport
from plait.tools.graceful_stop import StopRequests, signal_name
from plait.tools.launch_errors import record_rank_error
from plait.tools.output import make_console
from plait.tools.rank_notices import quiet_repeated_notices
from plait.tools.run_records import EarlierSteps, RunRecords

if TYPE_CHECKING:
    from plait.plugins.checkpoint import Checkpointer
    from plait.plugins.data.step_sampler import StepSampler
    from plait.plugins.fault_tolerance import FaultTolerantSteps

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


def _rank_peak(engine: Engine) -> PeakFlops:
    """This rank's peak for the job's compute dtype: the same figure the daemon divides by."""
    from plait.core.telemetry_resource import peak_flops_for_job

    return peak_flops_for_job(engine.job_info())


def run_training(config: PlaitConfig, *, console: Console | None = None) -> TrainingSummary:
    """Train for `config.train.steps` steps; rank 0 shows live progress."""
    from plait.core.quorum_events import BOARD as QUORUM_EVENT_BOARD
    from plait.plugins.checkpoint import Checkpointer
    from plait.plugins.data import build_batches
    from plait.plugins.fault_tolerance.data_share import replica_data_coordinates
    from plait.plugins.resilience import attach_resilience, resilience_config
    from plait.tools.validation import Validation, check_validation_layout

    quiet_repeated_notices(os.environ)
    engine = Engine(config=config)
    mesh = engine.mesh
    is_leader = mesh.rank == 0
    console = console or make_console(stderr=False)
    train = config.train
    if train.eval_every:
        check_validation_layout(engine)
    holdout = train.eval_fraction if train.eval_every else 0.0
    # Replica groups of a fault-tolerant job read their own shares of the global batch.
    data_rank, data_size = replica_data_coordinates(
        dp_rank=mesh.coordinate("dp"), dp_size=mesh.size("dp"), settings=config.fault_tolerance
    )
    split_batches = {
        split: build_batches(
            config.data,
            seq_len=config.data.seq_len,
            global_batch_size=train.global_batch_size,
            dp_rank=data_rank,
            dp_size=data_size,
            seed=train.seed,
            holdout=holdout,
            split=split,
        )
        for split in (("train", "validation") if holdout else ("train",))
    }
    batches = split_batches["train"]
    _check_vocabulary(engine, batches.vocab_size)
    validation = (
        Validation(engine, split_batches["validation"]) if "validation" in split_batches else None
    )
    checkpointer = Checkpointer.from_config(engine, batches, config)
    # Before the NaN guard: the guard then judges the gradients averaged across the groups, so
    # every group skips (or takes) a step alike.
    replica_groups = _join_replica_groups(engine, batches, config)
    attach_resilience(engine, resilience_config(config))
    start_step = checkpointer.maybe_resume()
    if replica_groups is not None:
        replica_groups.resume_from(start_step)
    rank_peak = _rank_peak(engine) if is_leader else PeakFlops(0.0, "")
    # Every rank of a job runs on the same kind of device, so the job's peak is W × the rank's.
    peak = rank_peak.flops * mesh.world_size
    summary = TrainingSummary(first_step=start_step)
    records = (
        RunRecords(engine, Path(train.run_dir).expanduser(), peak_flops=peak, start_step=start_step)
        if is_leader and train.run_dir
        else None
    )
    stop = StopRequests(engine.comm, world_size=mesh.world_size, device=engine.device).install()
    if is_leader:
        from plait.tools.banner import run_lines

        for line in run_lines(engine, rank_peak, batches):
            # Paths, model names and config values: plain text.
            console.print(line, highlight=False, soft_wrap=True, markup=False)
    live = is_leader and console.is_terminal
    progress = Progress(
        TextColumn("[bold]step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        disable=not live,
        transient=False,
    )
    start = time.perf_counter()
    tokens_done = 0
    step_seconds = 0.0  # the steps' own time, as metrics.jsonl records it (no eval, no saves)
    with progress:
        task = progress.add_task("train", total=train.steps, completed=start_step, stats="")
        step = start_step
        while step < train.steps:
            data_start = time.time_ns()
            if replica_groups is not None:
                # Retried until it commits; a healed group continues at its peer's step.
                outcome = replica_groups.step_until_committed(data_start_ns=data_start)
                step, loss = outcome.step, outcome.loss
                if is_leader and outcome.events:
                    # One report per group: its rank 0 logs them and sends them to the daemon.
                    QUORUM_EVENT_BOARD.publish(outcome.events, replica_id=replica_groups.replica_id)
                for event in outcome.events if is_leader else ():
                    # A failed commit carries the peer's error, Gloo's `[/path/pair.cc:553]`
                    # included: plain text, never markup.
                    console.print(event.describe(), highlight=False, soft_wrap=True, markup=False)
            else:
                batch = batches.next_batch()
                loss = engine.train_step(batch, data_start_ns=data_start)
            report = engine.last_report
            assert report is not None
            steps_done = step + 1
            summary.losses.append(loss)
            tokens_done += report.tokens
            step_seconds += report.step_seconds
            val_loss = None
            if validation is not None and validation.due(
                steps_done, last=steps_done == train.steps
            ):
                val_loss = validation.loss()
                summary.val_losses[steps_done] = val_loss
            if records is not None:
                records.step(report, val_loss=val_loss)
            if is_leader:
                stats = _format_stats(report, peak)
                progress.update(task, completed=steps_done, stats=stats)
                if not live and (
                    steps_done % train.log_every == 0
                    or steps_done == train.steps
                    or step == start_step
                ):
                    elapsed = time.perf_counter() - start
                    eta = elapsed / (steps_done - start_step) * (train.steps - steps_done)
                    console.print(
                        f"step {steps_done}/{train.steps} {stats} | elapsed "
                        f"{_clock(elapsed)} eta {_clock(eta)}",
                        highlight=False,
                        soft_wrap=True,
                    )
                if val_loss is not None:
                    console.print(
                        f"step {steps_done}/{train.steps} validation loss {val_loss:.4f}",
                        highlight=False,
                        soft_wrap=True,
                    )
            # Under fault tolerance one group writes the job's checkpoint (any group resumes).
            writes = replica_groups is None or replica_groups.writes_checkpoints
            if writes:
                checkpointer.maybe_save(steps_done)
            signum = stop.agreed()
            if signum is not None:
                summary.stopped = _stop_gracefully(
                    checkpointer, step + 1, signum, console, is_leader, writes=writes
                )
                break
            step += 1
    stop.uninstall()
    if replica_groups is not None:
        replica_groups.close()
    if records is not None:
        records.close()
    checkpointer.close()
    elapsed = time.perf_counter() - start
    summary.tokens_per_second = tokens_done / elapsed
    summary.mfu = mfu(engine.flops_per_token * summary.tokens_per_second, peak)
    summary.memory = engine.memory_report()
    earlier = records.earlier if records is not None else EarlierSteps()
    summary.run_steps = earlier.steps + len(summary.losses)
    summary.run_tokens = earlier.tokens + tokens_done
    summary.run_seconds = earlier.seconds + step_seconds
    if is_leader:
        _print_summary(console, summary)
    engine.close()
    return summary


def _join_replica_groups(
    engine: Engine, batches: StepSampler, config: PlaitConfig
) -> FaultTolerantSteps | None:
    """This group's fault-tolerant steps when `[fault_tolerance]` names a replica group; call
    `resume_from` once a disk checkpoint was resumed (a live peer further on still heals it)."""
    if not config.fault_tolerance.enabled:
        return None
    from plait.plugins.fault_tolerance import FaultTolerantSteps

    return FaultTolerantSteps.attach(engine, batches, config.fault_tolerance)


def _check_vocabulary(engine: Engine, data_vocab: int) -> None:
    """Token ids beyond the model's embedding would fail inside the first forward."""
    model_vocab = getattr(engine.model_config, "vocab_size", None)
    if isinstance(model_vocab, int) and data_vocab > model_vocab:
        raise ConfigError(
            f"the data's tokenizer has {data_vocab:,} ids but the model's vocabulary is "
            f"{model_vocab:,}; set model.overrides.vocab_size = {data_vocab} (or more)"
        )


def _stop_gracefully(
    checkpointer: Checkpointer,
    steps_done: int,
    signum: int,
    console: Console,
    is_leader: bool,
    *,
    writes: bool = True,
) -> str:
    """Save after the step every rank finished (unless that step was just saved, or another
    replica group writes the job's checkpoints) and say so."""
    from plait.plugins.checkpoint.storage import step_dir_name

    saved = checkpointer.root is not None and writes
    if saved and checkpointer.last_saved_step != steps_done:
        checkpointer.save(steps_done)
    checkpointer.wait()
    if saved:
        where = f"checkpoint {checkpointer.root / step_dir_name(steps_done)}"
    elif checkpointer.root is not None:
        where = "no checkpoint (another replica group writes the job's checkpoints)"
    else:
        where = "no checkpoint (checkpoint_io.dir is not set)"
    message = f"stopped by {signal_name(signum)} after step {steps_done}: {where}"
    if is_leader:
        console.print(Text(message, style="yellow"), highlight=False)
    return message


def _format_stats(report: StepReport, peak: float) -> str:
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


def _clock(seconds: float) -> str:
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


def _print_summary(console: Console, summary: TrainingSummary) -> None:
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
            f"over {_clock(summary.run_seconds)} of step time"
        )
    console.print(f"throughput: {attempt}", highlight=False, soft_wrap=True)
    mem = summary.memory
    console.print(
        "memory (rank 0): "
        + " · ".join(f"{k.replace('_', ' ')} {v / 2**20:,.2f} MiB" for k, v in mem.items()),
        highlight=False,
        soft_wrap=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plait-trainer")
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        run_training(config)
    except PlaitError as exc:
        # Under torchrun the launcher prints the root cause once, from the rank's error file.
        if not record_rank_error(exc, os.environ):
            print(f"rank {os.environ.get('RANK', '0')}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not record_rank_error(exc, os.environ):
            raise
        return 1
    finally:
        _release_process_group()
    return 0


def _release_process_group() -> None:
    """Tear the process group down before the interpreter exits: a rank leaving with it alive
    (after an error) aborts in C++ ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
