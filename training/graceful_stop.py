"""A graceful stop for `plait train`: finish the step, save, exit with the step and the path.

Schedulers send SIGTERM before they kill a job (Slurm can send SIGUSR1 ahead of preemption with
`--signal=USR1@90`); a person presses Ctrl-C. The first signal on any rank asks every rank to
stop after the step it is running: after each step the ranks agree with one all-reduce of a
one-element flag (so all of them stop after the *same* step, whichever got the signal and
when), then the trainer saves a checkpoint when `checkpoint_io.dir` is set. A second signal
aborts at once with the signal's default action.
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import TYPE_CHECKING

import torch
from rich.text import Text

from plait.core.comm import Comm, world_group
from plait.core.comm_algorithms import GENERIC

if TYPE_CHECKING:
    from rich.console import Console

    from plait.plugins.checkpoint import Checkpointer

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequests:
    """Signal handlers for one rank, and the per-step agreement across ranks."""

    def __init__(self, comm: Comm, *, world_size: int, device: torch.device) -> None:
        self.comm = comm
        self.world_size = world_size
        self.device = device  # NCCL reduces device tensors
        self.received: int | None = None  # the first signal this rank got
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequests:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.received is None:
            self.received = signum
            return
        # A second signal: stop waiting for the step to finish.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def agreed(self) -> int | None:
        """After a step: the signal that stops the job (on every rank the same), or `None`."""
        flag = torch.tensor([float(self.received or 0)], device=self.device)
        if self.world_size > 1:
            self.comm.all_reduce(flag, group=world_group(), op="max", purpose=GENERIC)
        signum = int(flag.item())
        return signum or None


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def save_and_stop(
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
