"""A third-party plugin for the fault-tolerance CLI test, found through the `plait` entry-point
group like any other (the test writes its dist-info on `PYTHONPATH`).

Every rank appends `STEP PID TIME` to `<PLAIT_TEST_MARKS>/rank<R>.steps` at the end of each
step try. With `PLAIT_TEST_HOLD=STEP[,STEP...]`, the ranks hold at the end of each of those steps
(once each) until the file `<PLAIT_TEST_MARKS>/go.<STEP>` exists, after writing
`held.<STEP>.rank<R>`: the test decides when a group goes on (once another group waits at the
lighthouse), so the order of events never rests on timing. `PLAIT_TEST_HOLD_RANKS=R[,R...]`
holds only those ranks (the others go on into the next step's collectives and wait there).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from plait.core.hookspecs import hookimpl
from plait.core.step import StepReport

HOLD_LIMIT_SECONDS = 300.0


def _marks() -> Path | None:
    where = os.environ.get("PLAIT_TEST_MARKS")
    return Path(where) if where else None


class HoldPlugin:
    def __init__(self) -> None:
        self.held: set[int] = set()

    @hookimpl
    def plait_step_end(self, report: StepReport) -> None:
        marks = _marks()
        if marks is None:
            return
        rank, step = os.environ.get("RANK", "0"), report.step + 1
        with (marks / f"rank{rank}.steps").open("a") as out:
            out.write(f"{step} {os.getpid()} {time.time():.6f}\n")
        holds = {int(s) for s in os.environ.get("PLAIT_TEST_HOLD", "").split(",") if s}
        held_ranks = {s for s in os.environ.get("PLAIT_TEST_HOLD_RANKS", "").split(",") if s}
        if step not in holds or step in self.held or (held_ranks and rank not in held_ranks):
            return
        self.held.add(step)
        (marks / f"held.{step}.rank{rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_LIMIT_SECONDS
        while not (marks / f"go.{step}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the test never released the hold at step {step}")
            time.sleep(0.05)
        with (marks / f"rank{rank}.steps").open("a") as out:
            out.write(f"released {os.getpid()} {time.time():.6f}\n")


plugin = HoldPlugin()
