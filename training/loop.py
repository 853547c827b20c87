"""The per-rank training loop behind `plait train`: engine, data, the step's source, and what
runs around each step (validation, run records, checkpoints, a graceful stop, progress).

    summary = run_training(load_config("configs/tiny.toml"))

torchrun runs it on every rank through `python -m plait.tools.trainer CONFIG [--set k=v ...]`
(what `plait train` launches); tests and a single process call `run_training` directly. Each
feature is a component built in `run_training` and asked after every step, in one order; a
feature that needs more adds a component here, not a branch inside the loop.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from plait.core.config import PlaitConfig
from plait.core.engine import Engine
from plait.training.data import TrainingData
from plait.training.graceful_stop import StopRequests, save_and_stop
from plait.training.output import make_console
from plait.training.progress import TrainingProgress
from plait.training.rank_notices import quiet_repeated_notices
from plait.training.run_records import EarlierSteps, RunRecords
from plait.training.steps import step_source
from plait.training.summary import TrainingSummary

__all__ = ["TrainingSummary", "run_training"]


def run_training(config: PlaitConfig, *, console: Console | None = None) -> TrainingSummary:
    """Train for `config.train.steps` steps; rank 0 shows live progress."""
    from plait.plugins.checkpoint import Checkpointer
    from plait.plugins.resilience import attach_resilience, resilience_config
    from plait.training.validation import Validation

    quiet_repeated_notices(os.environ)
    engine = Engine(config=config)
    console = console or make_console(stderr=False)
    train = config.train
    data = TrainingData.build(engine, config)
    validation = Validation(engine, data.validation) if data.validation is not None else None
    checkpointer = Checkpointer.from_config(engine, data.train, config)
    steps = step_source(engine, data.train, config, console)  # before the NaN/Inf guard
    attach_resilience(engine, resilience_config(config))
    start_step = checkpointer.maybe_resume()
    steps.resume_from(start_step)
    progress = TrainingProgress(engine, console, start_step=start_step)
    records = _run_records(engine, progress.peak, start_step)
    stop = StopRequests(engine.comm, world_size=engine.mesh.world_size, device=engine.device)
    stop.install()
    progress.banner(data.train)
    summary = TrainingSummary(first_step=start_step)
    with progress.running():
        step = start_step
        while step < train.steps:
            ran = steps.run(step)
            steps_done = ran.step + 1
            val_loss = validation.loss_after(steps_done) if validation is not None else None
            summary.record(ran, val_loss)
            if records is not None:
                records.step(ran.report, val_loss=val_loss)
            progress.step(ran, val_loss=val_loss)
            # Under fault tolerance one group writes the job's checkpoint (any group resumes).
            if steps.writes_checkpoints:
                checkpointer.maybe_save(steps_done)
            signum = stop.agreed()
            if signum is not None:
                summary.stopped = save_and_stop(
                    checkpointer,
                    steps_done,
                    signum,
                    console,
                    progress.leader,
                    writes=steps.writes_checkpoints,
                )
                break
            step = steps_done
    stop.uninstall()
    steps.close()
    if records is not None:
        records.close()
    checkpointer.close()
    summary.saves = list(checkpointer.timings)
    earlier = records.earlier if records is not None else EarlierSteps()
    summary.finish(engine, elapsed=progress.elapsed, peak=progress.peak, earlier=earlier)
    progress.summary(summary)
    engine.close()
    return summary


def _run_records(engine: Engine, peak: float, start_step: int) -> RunRecords | None:
    """Rank 0's metrics.jsonl (and TensorBoard events) under `train.run_dir`, when set."""
    run_dir = engine.config.train.run_dir
    if engine.mesh.rank != 0 or not run_dir:
        return None
    return RunRecords(engine, Path(run_dir).expanduser(), peak_flops=peak, start_step=start_step)
