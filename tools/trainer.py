"""The per-rank training loop behind `plait train`: engine, data, progress bar, summary.

Launched by torchrun (`python -m plait.tools.trainer CONFIG [--set k=v ...]`); also callable
in-process (`run_training(config)`) for tests and a single process.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from plait.core.config import PlaitConfig, load_config
from plait.core.engine import Engine
from plait.core.errors import PlaitError
from plait.core.mfu import format_mfu, mfu
from plait.core.peak_flops import PeakFlops
from plait.core.step import StepReport
from plait.tools.graceful_stop import StopRequests, signal_name
from plait.tools.run_records import RunRecords

if TYPE_CHECKING:
    from plait.plugins.checkpoint import Checkpointer


@dataclass
class TrainingSummary:
    losses: list[float] = field(default_factory=list)
    stopped: str = ""  # why training ended before train.steps (a signal), or ""
    tokens_per_second: float = 0.0
    mfu: float = 0.0
    memory: dict[str, int] = field(default_factory=dict)


def _rank_peak(engine: Engine) -> PeakFlops:
    """This rank's peak for the job's compute dtype: the same figure the daemon divides by."""
    from plait.core.telemetry import peak_flops_for_job

    return peak_flops_for_job(engine._job_info())


def run_training(config: PlaitConfig, *, console: Console | None = None) -> TrainingSummary:
    """Train for `config.train.steps` steps; rank 0 shows live progress."""
    from plait.plugins.checkpoint import Checkpointer
    from plait.plugins.data import build_batches

    engine = Engine(config=config)
    mesh = engine.mesh
    is_leader = mesh.rank == 0
    console = console or Console(stderr=False)
    batches = build_batches(
        config.data,
        seq_len=config.data.seq_len,
        global_batch_size=config.train.global_batch_size,
        dp_rank=mesh.coordinate("dp"),
        dp_size=mesh.size("dp"),
        seed=config.train.seed,
    )
    checkpointer = Checkpointer.from_config(engine, batches, config)
    start_step = checkpointer.maybe_resume()
    rank_peak = _rank_peak(engine) if is_leader else PeakFlops(0.0, "")
    # Every rank of a job runs on the same kind of device, so the job's peak is W × the rank's.
    peak = rank_peak.flops * mesh.world_size
    summary = TrainingSummary()
    records = (
        RunRecords(engine, Path(config.train.run_dir).expanduser(), peak_flops=peak)
        if is_leader and config.train.run_dir
        else None
    )
    stop = StopRequests(engine.comm, world_size=mesh.world_size, device=engine.device).install()
    if is_leader:
        _print_header(console, engine, rank_peak)
    progress = Progress(
        TextColumn("[bold]step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not is_leader or not console.is_terminal,
        transient=False,
    )
    start = time.perf_counter()
    tokens_done = 0
    with progress:
        task = progress.add_task("train", total=config.train.steps, stats="")
        for step in range(start_step, config.train.steps):
            data_start = time.time_ns()
            batch = batches.next_batch()
            loss = engine.train_step(batch, data_start_ns=data_start)
            report = engine.last_report
            summary.losses.append(loss)
            tokens_done += report.tokens
            if records is not None:
                records.step(report)
            if is_leader:
                stats = _format_stats(report, peak)
                progress.update(task, completed=step + 1, stats=stats)
                if not console.is_terminal and (
                    step % config.train.log_every == 0 or step == config.train.steps - 1
                ):
                    console.print(f"step {step + 1}/{config.train.steps} {stats}", highlight=False)
            checkpointer.maybe_save(step + 1)
            signum = stop.agreed()
            if signum is not None:
                summary.stopped = _stop_gracefully(
                    checkpointer, step + 1, signum, console, is_leader
                )
                break
    stop.uninstall()
    if records is not None:
        records.close()
    checkpointer.close()
    elapsed = time.perf_counter() - start
    summary.tokens_per_second = tokens_done / elapsed
    summary.mfu = mfu(engine.flops_per_token * summary.tokens_per_second, peak)
    summary.memory = engine.memory_report()
    if is_leader:
        _print_summary(console, summary)
    engine.close()
    return summary


def _stop_gracefully(
    checkpointer: Checkpointer, steps_done: int, signum: int, console: Console, is_leader: bool
) -> str:
    """Save after the step every rank finished (unless that step was just saved) and say so."""
    from plait.plugins.checkpoint.storage import step_dir_name

    saved = checkpointer.root is not None
    if saved and checkpointer.last_saved_step != steps_done:
        checkpointer.save(steps_done)
    checkpointer.wait()
    where = (
        f"checkpoint {checkpointer.root / step_dir_name(steps_done)}"
        if saved
        else "no checkpoint (checkpoint_io.dir is not set)"
    )
    message = f"stopped by {signal_name(signum)} after step {steps_done}: {where}"
    if is_leader:
        console.print(f"[yellow]{message}[/yellow]", highlight=False)
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


def _print_header(console: Console, engine: Engine, rank_peak: PeakFlops) -> None:
    cfg = engine.config
    num_params = sum(p.numel() for p in engine.module.parameters())
    degrees = " ".join(f"{k}={v}" for k, v in engine.mesh.degrees.items())
    console.print(
        f"[bold]plait[/bold] {cfg.model.name}/{cfg.model.size} · {num_params:,} parameters "
        f"per rank · {engine.mesh.world_size} ranks ({degrees}) on {engine.device} · "
        f"dp strategy {cfg.parallel.dp_strategy} · schedule {cfg.schedule.name}",
        highlight=False,
    )
    pipeline = engine.context.pipeline
    if pipeline is not None:
        console.print(f"pipeline stages: {pipeline.summary}", highlight=False)
    world_size = engine.mesh.world_size
    console.print(
        f"model FLOPs/token {engine.flops_per_token:,.0f} · peak used for MFU: "
        f"{rank_peak.flops * world_size / 1e9:,.1f} GFLOP/s = {world_size} × "
        f"{rank_peak.flops / 1e9:,.1f} per rank ({rank_peak.source})",
        highlight=False,
    )
    if engine.device.type == "cpu":
        from plait.core.peak_flops import calibration_path

        console.print(f"CPU peak cached in {calibration_path()}", highlight=False)


def _print_summary(console: Console, summary: TrainingSummary) -> None:
    first, last = summary.losses[0], summary.losses[-1]
    console.print(
        f"[bold]done[/bold]: loss {first:.4f} → {last:.4f} · {summary.tokens_per_second:,.0f} "
        f"tok/s · MFU {format_mfu(summary.mfu)}",
        highlight=False,
    )
    mem = summary.memory
    console.print(
        "memory (rank 0): " + " · ".join(f"{k} {v / 2**20:,.2f} MiB" for k, v in mem.items()),
        highlight=False,
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
        rank = os.environ.get("RANK", "0")
        print(f"rank {rank}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
