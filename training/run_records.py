"""Run records: what a finished (or stopped) run leaves behind for the person who ran it.

With `train.run_dir` set, rank 0 writes there:

- `config.toml` — the fully resolved config: every core field, the degrees as the mesh resolved
  them (`parallel.dp = -1` becomes the actual degree), and the section of every plugin the run
  selected and every section a feature declares (`[checkpoint_io]`, `[resilience]`, …) with
  their defaults filled in;
- `metrics.jsonl` — one JSON object per optimizer step: step (1-based, as the progress line
  counts), loss, lr, grad_norm, tokens, tokens_per_second, mfu, step_seconds, skipped,
  memory_bytes (parameters + gradients + optimizer state on rank 0) and val_loss (the held-out
  loss on the steps that ran a validation, else null). A resumed run appends, so the file covers
  the whole run across restarts; steps after the checkpoint it resumed from (done again) are
  dropped first, so every step appears once;
- `tensorboard/` — the same figures as TensorBoard scalars (`train/…`, `val/loss`) when the
  `tensorboard` package is installed (`pip install plait[tensorboard]`); a resumed run purges
  the events after its checkpoint the same way.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from plait.core.config import dump_toml
from plait.core.engine import Engine
from plait.core.step import StepReport
from plait.daemon.mfu import mfu

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def resolved_config(engine: Engine) -> dict[str, Any]:
    """The config as the run used it, plugin defaults and resolved degrees included."""
    config = engine.config
    data = config.model_dump(mode="json")
    data["parallel"].update(engine.mesh.degrees)
    plugins = engine.plugins
    selected = {config.parallel.dp_strategy, *config.parallel.transform_strategies().values()}
    for axis in ("pp", "tp", "cp"):
        if engine.mesh.size(axis) > 1:
            selected.add(getattr(config.parallel, f"{axis}_strategy"))
    for (_, name), (_, record) in plugins.strategies().items():
        if name in selected and record.config_cls is not None:
            section = record.config_section or name
            data[section] = config.section(section, record.config_cls).model_dump(mode="json")
    # The sections features declare (`[checkpoint_io]`, `[fault_tolerance]`, …), defaults
    # filled in, as `plait config show` prints them.
    for name, (_, record) in plugins.config_sections().items():
        data[name] = config.section(name, record.config_cls).model_dump(mode="json")
    return data


@dataclass(frozen=True, slots=True)
class EarlierSteps:
    """What the attempts before this one recorded (steps up to the resumed checkpoint)."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class RunRecords:
    """Rank 0's writer of `config.toml`, `metrics.jsonl` and TensorBoard events in the run dir.

    `start_step` is the number of steps already done (the checkpoint resumed from, 0 for a new
    run): records of later steps, left by an attempt that failed after that checkpoint, are
    dropped since this attempt does those steps again.
    """

    def __init__(
        self, engine: Engine, run_dir: Path, *, peak_flops: float, start_step: int = 0
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.engine = engine
        (run_dir / "config.toml").write_text(dump_toml(resolved_config(engine)))
        self.peak_flops = peak_flops
        self.earlier = _keep_steps_up_to(run_dir / METRICS_FILE, start_step)
        self._metrics: IO[str] = (run_dir / METRICS_FILE).open("a", buffering=1)
        self._tensorboard: Any = None
        if tensorboard_available():
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events of steps this attempt does again (after a failure).
            self._tensorboard = SummaryWriter(
                str(run_dir / TENSORBOARD_DIR), purge_step=start_step + 1, flush_secs=10
            )

    def step(self, report: StepReport, *, val_loss: float | None = None) -> None:
        seconds = report.step_seconds
        step = report.step + 1
        record = {
            "step": step,
            "loss": _finite(report.loss),
            "lr": report.lr,
            "grad_norm": _finite(report.grad_norm),
            "tokens": report.tokens,
            "tokens_per_second": report.tokens / seconds if seconds else 0.0,
            "mfu": mfu(report.model_flops / seconds, self.peak_flops) if seconds else 0.0,
            "step_seconds": seconds,
            "skipped": report.skipped,
            "memory_bytes": self.engine.memory_report()["total"],
            "val_loss": _finite(val_loss),
        }
        self._metrics.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            for name, value in record.items():
                if name in ("step", "val_loss") or value is None:
                    continue
                self._tensorboard.add_scalar(f"train/{name}", float(value), step)
            if record["val_loss"] is not None:
                self._tensorboard.add_scalar("val/loss", record["val_loss"], step)

    def close(self) -> None:
        self._metrics.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _keep_steps_up_to(path: Path, last_step: int) -> EarlierSteps:
    """Drop the records after `last_step` from `path`; total what remains."""
    if not path.is_file():
        return EarlierSteps()
    kept: list[str] = []
    tokens, seconds = 0, 0.0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if not isinstance(record, dict) or not 1 <= int(record.get("step", 0)) <= last_step:
            continue
        kept.append(line)
        tokens += int(record.get("tokens", 0))
        seconds += float(record.get("step_seconds", 0.0))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
    return EarlierSteps(steps=len(kept), tokens=tokens, seconds=seconds)


def _finite(value: float | None) -> float | None:
    # JSON has no NaN or infinity: a diverged step is written as null.
    return value if value is not None and math.isfinite(value) else None
