"""Two daemons, as on two nodes, each seeing one rank of a 2-rank job: `plait profile` with both
hosts merges every rank into one trace; a rank held in a collective while the other sleeps in
user code shows in `plait stacks` and `plait status` with both stacks."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from plait.testing.distributed import run_distributed
from plait.tools.cli import app
from tests.daemon.profile_workers import JOB_ID, train_on_two_daemons

runner = CliRunner()


def wait_for(predicate, what: str, timeout: float = 180.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def cli(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env={"COLUMNS": "220"})
    return result.exit_code, result.output


class Job:
    """The 2-rank job running in a background thread until told to stop."""

    def __init__(self, daemons: list[DaemonServer], control_dir: Path) -> None:
        self.daemons, self.control_dir = daemons, control_dir
        self.results: list = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.results = run_distributed(
                train_on_two_daemons, 2, [d.address for d in self.daemons],
                str(self.control_dir), timeout=400,
                env={"PLAIT_HEARTBEAT_INTERVAL_MS": "200"},
            )  # fmt: skip
        except BaseException as exc:  # reported by the test that joins
            self.error = exc

    def hosts(self) -> list[str]:
        return [arg for d in self.daemons for arg in ("--host", d.address)]


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    with (
        DaemonServer("127.0.0.1:0", host_interval=1.0, hang_timeout=1.0) as a,
        DaemonServer("127.0.0.1:0", host_interval=1.0, hang_timeout=1.0) as b,
    ):
        running = Job([a, b], tmp_path)
        running.thread.start()
        try:

            def polling(server: DaemonServer) -> bool:
                views = server.control.endpoints(JOB_ID, time.time_ns())
                return len(views) == 1 and views[0].polling and views[0].hello.step >= 3

            wait_for(lambda: running.error is None and polling(a) and polling(b), "both ranks")
            yield running
        finally:
            for name in ("stop", "release"):
                (tmp_path / name).touch()
            running.thread.join(timeout=300)
    assert running.error is None, running.error


def _hang(server: DaemonServer) -> list:
    channel = grpc.insecure_channel(server.address)
    try:
        return list(daemon_pb2_grpc.DaemonStub(channel).Status(daemon_pb2.StatusRequest()).hangs)
    finally:
        channel.close()


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_profile_merges_both_daemons_and_a_hang_shows_both_stacks(job: Job, tmp_path: Path) -> None:
    a, b = job.daemons
    # Each daemon sees one rank: one trace holds both, on one clock, with the same steps.
    output = tmp_path / "merged.json"
    code, printed = cli("profile", "--job", JOB_ID, "--steps", "2", "-o", str(output),
                        "--json", *job.hosts())  # fmt: skip
    assert code == 0, printed
    answer = json.loads(printed)
    document = json.loads(output.read_text())
    processes = document["otherData"]["processes"]
    assert sorted(p["rank"] for p in processes.values()) == [0, 1]
    assert {p["rank"]: p["daemon"] for p in processes.values()} == {0: a.address, 1: b.address}
    start = answer["start_step"]
    for pid in processes:
        steps = sorted(
            e["name"] for e in document["traceEvents"]
            if e["pid"] == int(pid) and e["name"].startswith("ProfilerStep#")
        )  # fmt: skip
        assert steps == [f"ProfilerStep#{start}", f"ProfilerStep#{start + 1}"]
    figures = answer["analysis"]["ranks"]
    assert sorted(f["rank"] for f in figures) == [0, 1] and all(f["steps"] == 2 for f in figures)
    # Analysed as one job: the rank that entered a bucket first waited for the other.
    assert sum(f["idle_peer_wait_seconds"] for f in figures) > 0

    # Rank 0 enters an all-reduce; rank 1 sleeps in user code. Both daemons are asked.
    (tmp_path / "hang").touch()
    wait_for(lambda: bool(_hang(a)), "daemon A to see rank 0 stuck", timeout=120)
    code, printed = cli("stacks", "--job", JOB_ID, "--json", *job.hosts())
    assert code == 0, printed
    stacks = {r["rank"]: r for r in json.loads(printed)["ranks"]}
    assert sorted(stacks) == [0, 1]

    def training_frames(rank: int) -> list[dict]:
        (thread,) = [t for t in stacks[rank]["threads"] if t["training"]]
        return thread["frames"]

    stuck = training_frames(0)
    collective = [f for f in stuck if f["function"] == "all_reduce"]
    assert any(f["file"].endswith(os.path.join("core", "comm.py")) for f in collective), stuck
    assert any("distributed_c10d" in f["file"] for f in collective), stuck
    assert "all_reduce seq" in " ".join(stacks[0]["in_flight"])
    sleeping = training_frames(1)
    assert sleeping[-1]["function"] == "sleep_in_user_code", sleeping[-3:]
    assert stacks[1]["in_flight"] == []

    code, printed = cli("status", *job.hosts())
    assert "collective hangs" in printed and "stuck_test" in printed
    assert "stacks of the ranks in the hung collectives" in printed
    assert "in sleep_in_user_code" in printed and "in all_reduce" in printed
    assert "in collective: all_reduce seq" in printed
    code, printed = cli("status", "--json", *job.hosts())
    hang_stacks = json.loads(printed)["hang_stacks"]
    assert sorted(s["rank"] for s in hang_stacks) == [0, 1]

    (tmp_path / "release").touch()  # rank 1 joins the all-reduce; both finish
    job.thread.join(timeout=300)
    assert job.error is None, job.error
    assert [r["hung"] for r in job.results] == [True, True]
