"""A lost replica group costs a step, not a restart (torchft's quorum driven by plait).

Two replica groups train under the lighthouse a daemon hosts (`plait daemon --lighthouse`); group
B dies (SIGKILL) inside step k. Group A keeps its processes, reads no checkpoint, does not commit
step k and retries it alone; a replacement B' heals from A and takes part from step j + 1. At the
end A and B' hold the same weights, bit for bit, and both equal one process replaying the same
schedule. And the daemon that hosts the lighthouse shows it while it happens: group B left
(its heartbeat ageing at the lighthouse, A's `leave` event), then B′'s `heal`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from plait.testing.distributed import RankFailure, run_distributed
from plait.daemon.lighthouse import LighthouseSettings
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from tests.dist import fault_tolerance_workers as workers

pytestmark = pytest.mark.dist

TIMEOUT = 150.0
STALE_FLOOR = 3.0  # seconds: a dead group's ranks are stale (it left) this long after it died


class Group(threading.Thread):
    """One replica group's ranks, run in the background; `result` or `error` when done."""

    def __init__(self, role: str, ranks: int, lighthouse: str, markers: Path, layout: Any) -> None:
        super().__init__(daemon=True)
        self.args = (role, lighthouse, str(markers), layout)
        self.ranks = ranks
        self.result: list[Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = run_distributed(
                workers.replica_group_rank, self.ranks, *self.args, timeout=TIMEOUT
            )
        except BaseException as exc:  # reported by the test
            self.error = exc


def _status(daemon: DaemonServer) -> daemon_pb2.StatusResponse:
    with grpc.insecure_channel(daemon.address) as channel:
        stub = daemon_pb2_grpc.DaemonStub(channel)
        return stub.Status(daemon_pb2.StatusRequest(), timeout=10)


def _status_once_b_left(daemon: DaemonServer) -> daemon_pb2.StatusResponse:
    """`plait status` while A waits for a replacement (up to `MARKER_WAIT_SECONDS`): the first
    answer where B has left and A's leave event is in."""
    deadline = time.monotonic() + workers.MARKER_WAIT_SECONDS / 2
    while True:
        status = _status(daemon)
        groups = {g.replica_group: g.state for j in status.fault_tolerant_jobs for g in j.groups}
        kinds = {e.kind for j in status.fault_tolerant_jobs for e in j.events}
        # A hung B goes silent (left) before A's quorum drops it (leave): wait for both.
        if groups.get(1) == "left" and "leave" in kinds:
            return status
        assert time.monotonic() < deadline, f"B never shown as left: {status}"
        time.sleep(0.1)


def _run_schedule(tmp_path: Path, *, ranks: int, layout: dict[str, Any]) -> dict[str, Any]:
    daemon = DaemonServer(
        bind="127.0.0.1:0",
        stale_floor=STALE_FLOOR,
        lighthouse=LighthouseSettings(
            bind="127.0.0.1:0", join_timeout_seconds=30.0, heartbeat_timeout_seconds=2.0
        ),
    ).start()
    assert daemon.lighthouse is not None
    address = daemon.lighthouse.address
    layout = {**layout, "daemon": daemon.address}
    try:
        group_a = Group("A", ranks, address, tmp_path, layout)
        group_b = Group("B", ranks, address, tmp_path, layout)
        group_a.start()
        group_b.start()
        workers.wait_for(tmp_path / "B-failed", "group B to fail", unless=group_b)
        workers.wait_for(tmp_path / "A-at-rejoin", "group A to reach the rejoin step")
        if layout.get("fault") == "SIGSTOP":
            # A went on without the hung group; now it is cleared away like a dead one.
            os.kill(int((tmp_path / "B-failed").read_text()), signal.SIGKILL)
        group_b.join(TIMEOUT)
        while_left = _status_once_b_left(daemon)  # A blocks until B' starts: B stays gone
        replacement = Group("B'", ranks, address, tmp_path, layout)
        replacement.start()
        group_a.join(TIMEOUT)
        replacement.join(TIMEOUT)
        (at_end,) = _status(daemon).fault_tolerant_jobs
    finally:
        daemon.stop(grace=0.5)
    assert group_a.error is None, group_a.error
    assert replacement.error is None, replacement.error
    assert isinstance(group_b.error, RankFailure) and "code -9" in str(group_b.error)
    return {"A": group_a.result, "B'": replacement.result, "left": while_left, "end": at_end}


def _committed_steps(tries: list[dict[str, Any]]) -> list[int]:
    return [t["step"] for t in tries if t["committed"]]


# NOTE: 2 x 2 with ZeRO-1 is the case; the hang (SIGSTOP, left out after the step
# timeout) runs at 2 x 1 DDP, which is what differs from the first case's layout.
@pytest.mark.parametrize(
    ("ranks", "layout"),
    [
        pytest.param(2, {"dp_strategy": "zero1", "global_batch_size": 8}, id="2x2-zero1"),
        pytest.param(
            1,
            {"dp_strategy": "ddp", "global_batch_size": 4, "fault": "SIGSTOP"}
            | {"step_timeout_seconds": 4.0},
            id="2x1-sigstop",
        ),
    ],
)
def test_lost_group_costs_one_step_and_the_replacement_heals_bitwise(
    tmp_path: Path, ranks: int, layout: dict[str, Any]
) -> None:
    results = _run_schedule(tmp_path, ranks=ranks, layout=layout)
    k, rejoin = workers.KILL_STEP, workers.REJOIN_STEP
    for rank_a in results["A"]:
        # A never restarted and never healed (no checkpoint, no peer state).
        assert rank_a["pid_at_start"] == rank_a["pid_at_end"]
        tries = rank_a["tries"]
        assert _committed_steps(tries) == list(range(workers.STEPS))
        failed = [t for t in tries if not t["committed"]]
        assert [t["step"] for t in failed] == [k]  # step k tried with B, not committed, retried
        assert failed[0]["participants"] == 2
        assert [t["participants"] for t in tries if t["committed"]] == [
            len(workers.participants_of(s)) for s in range(workers.STEPS)
        ]
        kinds = [e[0] for t in tries for e in t["events"]]
        assert "heal" not in kinds and "leave" in kinds and kinds.count("join") == 2
    for rank_b in results["B'"]:
        tries = rank_b["tries"]
        # Healed from A at the quorum of step j + 1: never trained from its own start.
        assert tries[0]["step"] == rejoin and ("heal", rejoin, 2, 0) in tries[0]["events"]
        assert _committed_steps(tries) == list(range(rejoin, workers.STEPS))
    # What `plait status` showed while B was gone: B left, A's leave, B's heartbeat ageing.
    (job,) = results["left"].fault_tolerant_jobs
    assert [(g.replica_group, g.state) for g in job.groups] == [(0, "participating"), (1, "left")]
    assert ("leave", 2, 1) in [(e.kind, e.previous, e.participants) for e in job.events]
    ages = {b.replica_group: b.age_seconds for b in results["left"].lighthouse.heartbeats}
    assert ages[1] > ages[0]
    # And once B' healed: its heal at the rejoin step, after A's leave.
    events = [(e.replica_group, e.kind, e.step) for e in results["end"].events]
    leave = events.index(next(e for e in events if e[1] == "leave"))
    assert (1, "heal", rejoin) in events[leave:]
    replay = run_distributed(workers.replay, 1, ranks, layout, timeout=TIMEOUT)[0]
    for rank, (rank_a, rank_b) in enumerate(zip(results["A"], results["B'"], strict=True)):
        for name, value in rank_a["weights"].items():
            assert torch.equal(value, rank_b["weights"][name]), f"rank {rank} {name}: A != B'"
            assert torch.equal(value, replay[name]), f"rank {rank} {name}: A != the replay"
