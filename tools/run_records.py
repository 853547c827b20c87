"""Run records: what a finished (or stopped) run leaves behind for the person who ran it.

With `train.run_dir` set, rank 0 writes there:

- `config.toml` — the fully resolved config: every core field, the degrees as the mesh resolved
  them (`parallel.dp = -1` becomes the actual degree), and the section of every plugin the run
  selected with its defaults filled in;
- `metrics.jsonl` — one JSON object per optimizer step: step (1-based, as the progress line
  counts), loss, lr, grad_norm, tokens, tokens_per_second, mfu, step_seconds, skipped. A resumed
  run appends, so the file covers the whole run across restarts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

from plait.core.config import dump_toml
from plait.core.engine import Engine
from plait.core.mfu import mfu
from plait.core.step import StepReport


def resolved_config(engine: Engine) -> dict[str, Any]:
    """The config as the run used it, plugin defaults and resolved degrees included."""
    config = engine.config
    data = config.model_dump(mode="json")
    data["parallel"].update(engine.mesh.degrees)
    plugins = engine.plugins
    selected = {config.parallel.dp_strategy, *config.parallel.transforms.values()}
    for axis in ("pp", "tp", "cp"):
        if engine.mesh.size(axis) > 1:
            selected.add(getattr(config.parallel, f"{axis}_strategy"))
    for (_, name), (_, record) in plugins.strategies().items():
        if name in selected and record.config_cls is not None:
            section = record.config_section or name
            data[section] = config.section(section, record.config_cls).model_dump(mode="json")
    return data


class RunRecords:
    """Rank 0's writer of `config.toml` and `metrics.jsonl` in `train.run_dir`."""

    def __init__(self, engine: Engine, run_dir: Path, *, peak_flops: float) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(dump_toml(resolved_config(engine)))
        self.peak_flops = peak_flops
        self._metrics: IO[str] = (run_dir / "metrics.jsonl").open("a", buffering=1)

    def step(self, report: StepReport) -> None:
        seconds = report.step_seconds
        record = {
            "step": report.step + 1,
            "loss": _finite(report.loss),
            "lr": report.lr,
            "grad_norm": _finite(report.grad_norm),
            "tokens": report.tokens,
            "tokens_per_second": report.tokens / seconds if seconds else 0.0,
            "mfu": mfu(report.model_flops / seconds, self.peak_flops) if seconds else 0.0,
            "step_seconds": seconds,
            "skipped": report.skipped,
        }
        self._metrics.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._metrics.close()


def _finite(value: float | None) -> float | None:
    # JSON has no NaN or infinity: a diverged step is written as null.
    return value if value is not None and math.isfinite(value) else None
