"""A third-party plugin for the checkpoint kill test, found through the `plait` entry-point group
(the test writes its dist-info on `PYTHONPATH`), so `plait train`'s own ranks load it.

Every rank appends `STEP LOSS` (the loss's `repr`) to `<PLAIT_TEST_MARKS>/rank<R>.losses` at the
end of each step. With `PLAIT_TEST_CKPT_HOLD=STEP` and `PLAIT_TEST_CKPT_HOLD_RANK=R`, rank R's
write of checkpoint STEP stops in the middle of its data file — the first tensor written and
flushed, the rest not — writes `held.<STEP>.rank<R>` (its pid inside) and waits until
`go.<STEP>` exists. The test kills the rank there: the order of events never rests on timing.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint.filesystem as dcp_filesystem

from plait.core.config import PlaitConfig
from plait.core.hookspecs import hookimpl
from plait.core.step import StepReport
from plait.plugins.checkpoint.storage import temp_dir_name

HOLD_LIMIT_SECONDS = 300.0


def _marks() -> Path | None:
    where = os.environ.get("PLAIT_TEST_MARKS")
    return Path(where) if where else None


def _rank() -> str:
    return os.environ.get("RANK", "0")


class CheckpointHoldPlugin:
    def __init__(self) -> None:
        self.installed = False

    @hookimpl
    def plait_configure(self, config: PlaitConfig) -> None:
        del config
        hold = os.environ.get("PLAIT_TEST_CKPT_HOLD")
        marks = _marks()
        if self.installed or not hold or marks is None:
            return
        if os.environ.get("PLAIT_TEST_CKPT_HOLD_RANK", "1") != _rank():
            return
        self.installed = True
        _hold_inside_write(int(hold), marks)

    @hookimpl
    def plait_step_end(self, report: StepReport) -> None:
        marks = _marks()
        if marks is None:
            return
        with (marks / f"rank{_rank()}.losses").open("a") as out:
            out.write(f"{report.step + 1} {report.loss!r}\n")


def _hold_inside_write(step: int, marks: Path) -> None:
    """Wrap DCP's per-item file write: after the first item of checkpoint `step`, hold."""
    real = dcp_filesystem._write_item
    held = threading.Event()

    def write_item(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        stream = args[1] if len(args) > 1 else kwargs["stream"]
        if temp_dir_name(step) in str(getattr(stream, "name", "")) and not held.is_set():
            held.set()
            stream.flush()  # a half-written file on disk, as a kill mid-write leaves it
            (marks / f"held.{step}.rank{_rank()}").write_text(str(os.getpid()))
            deadline = time.monotonic() + HOLD_LIMIT_SECONDS
            while not (marks / f"go.{step}").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the test never released the write of step {step}")
                time.sleep(0.05)
        return result

    dcp_filesystem._write_item = write_item  # type: ignore[assignment]


plugin = CheckpointHoldPlugin()
