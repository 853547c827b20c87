"""A replica group that lost a rank leaves the job at once, so the other groups go on.

When a rank of a group dies, torchrun's agent sends SIGTERM to the group's other ranks and waits
for them to exit. plait's ranks take SIGTERM as a graceful stop at the end of the step
(`plait.training.graceful_stop`), but the step of a group that lost a rank never ends by itself: its
ranks wait in torchft's quorum or commit vote for the dead one (inside torchft's Rust client,
where Python's signal handler cannot run) for up to `step_timeout_seconds`, and all that time
the group's manager keeps heartbeating to the lighthouse, which keeps waiting for the group
before it forms the survivors' next quorum.

`GroupLossExit` closes that gap: a thread woken by the signal (Python's wakeup fd, written by the
C-level handler even while the main thread is blocked) looks at this rank's sibling workers, and
when one of them has already exited — torchrun reaps a failed worker before it signals the
others — it ends this process at once. The manager's heartbeats stop with it, and the lighthouse
drops the group after its heartbeat timeout. A stop signal that finds every sibling alive (a
scheduler's SIGTERM, a person's Ctrl-C) keeps its graceful meaning.

Siblings are the ranks of this node: a group spread over nodes whose rank dies on another node
still leaves after `step_timeout_seconds`, when its ranks' waits time out.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Mapping

import psutil

# The signals torchrun's agent stops a failed worker's siblings with (SIGTERM), and the ones it
# forwards when it is itself stopped.
AGENT_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


def sibling_exited(environ: Mapping[str, str]) -> bool:
    """Whether a worker torchrun started beside this one on this node has exited: fewer live
    children of the agent than `LOCAL_WORLD_SIZE`. False outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in environ or "LOCAL_WORLD_SIZE" not in environ:
        return False
    try:
        agent = psutil.Process(os.getppid())
        live = [child for child in agent.children() if child.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return False  # the agent is gone or unreadable: nothing to conclude
    return len(live) < int(environ["LOCAL_WORLD_SIZE"])


class GroupLossExit:
    """Ends this rank's process when a stop signal arrives after a sibling rank died."""

    def __init__(self, *, replica_group: int, environ: Mapping[str, str] | None = None) -> None:
        self.replica_group = replica_group
        self.environ = os.environ if environ is None else environ
        self._read_fd = -1
        self._write_fd = -1
        self._thread: threading.Thread | None = None
        # Set each time the thread has judged the signals it was woken for (and stayed).
        self.judged = threading.Event()

    def start(self) -> GroupLossExit:
        """Install the wakeup fd and start the watching thread. Does nothing off the main
        thread, or when another part of the process already owns the wakeup fd."""
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only; its owner decides about them
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block on a full pipe
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return self
        self._read_fd, self._write_fd = read_fd, write_fd
        self._thread = threading.Thread(target=self._watch, name="plait-group-loss", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while True:
            try:
                received = os.read(self._read_fd, 64)
            except OSError:
                return
            if not received:  # `stop` closed the write end
                return
            if AGENT_STOP_SIGNALS.intersection(received) and sibling_exited(self.environ):
                self._leave()
            self.judged.set()

    def _leave(self) -> None:
        rank = self.environ.get("RANK", "?")
        sys.stderr.write(
            f"rank {rank}: replica group {self.replica_group} lost a rank on this node; leaving "
            "the job now so the other replica groups go on without it\n"
        )
        sys.stderr.flush()
        # No clean-up: the group's collectives wait on the dead rank, and every second spent
        # here is a second the lighthouse holds the other groups' quorum for this one.
        os._exit(1)

    def stop(self) -> None:
        """Give the wakeup fd back and end the thread (main thread only)."""
        if self._thread is None:
            return
        signal.set_wakeup_fd(-1)
        os.close(self._write_fd)
        self._thread.join(timeout=5.0)
        os.close(self._read_fd)
        self._thread = None
