"""Fault injection for restart and hang tests: a rank SIGKILLs (or SIGSTOPs) itself after a
given step.

With `scope = "node"` it first SIGKILLs its torchrun agent (its parent process), so the node
leaves the job as a crashed machine does: no agent is left to restart it, and the other nodes
must go on without it (an elastic `--nnodes MIN:MAX` range) or wait for it to come back.

Registered by `attach_resilience` only when `[resilience.fault_injection] kill_after_step` is
set, so production runs never carry it. A SIGKILL cannot be caught or cleaned up after: it is the
honest model of a machine or process dying mid-run.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING

from plait.core.hookspecs import hookimpl

if TYPE_CHECKING:
    from plait.core.step import StepReport
    from plait.plugins.resilience.config import FaultInjectionConfig


class FaultInjector:
    """A plugin object: on `plait_step_end` of the configured step and rank, SIGKILL."""

    def __init__(self, config: FaultInjectionConfig) -> None:
        self.config = config

    def _armed(self) -> bool:
        rank = int(os.environ.get("RANK", "0"))
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return rank == self.config.rank and not (self.config.only_first_attempt and attempt > 0)

    @hookimpl
    def plait_step_end(self, report: StepReport) -> None:
        if report.step + 1 != self.config.kill_after_step or not self._armed():
            return
        if self.config.signal == "SIGSTOP":
            # A hung rank: alive, its sockets open, answering nothing until SIGCONT or SIGKILL.
            print(
                f"fault injection: rank {self.config.rank} stops itself (SIGSTOP, pid "
                f"{os.getpid()}) after step {report.step + 1}",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        what = "its node" if self.config.scope == "node" else "itself"
        print(
            f"fault injection: rank {self.config.rank} kills {what} after step {report.step + 1}",
            file=sys.stderr,
            flush=True,
        )
        if self.config.scope == "node":
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
