"""Fault tolerance as an operator runs it: `plait daemon --lighthouse`, two `plait train` replica
groups of one job, one group's rank lost while both train.

The survivor keeps its worker processes and logs every step to the end, without waiting out a
timeout for the dead group (`GroupLossExit`: the broken group leaves at once); `plait status
--json --job J` shows the groups while it trains alone; a replacement started later heals from
it (its first step far past 1, its first loss a trained model's), and both exit 0. A replacement
with nobody to heal from, in a job that has trained, is refused by name.

Order comes from events, not timing: fault injection (`[resilience.fault_injection]`) kills or
stops group 1's rank 1 after a given step, and a plugin found through the `plait` entry-point
group (`ft_hold_plugin`) holds the survivor at a later step until the replacement waits at the
lighthouse.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from plait.daemon.lighthouse import read_lighthouse
from tests.e2e.hold_plugin_site import install_hold_plugin, plugin_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
JOB = "ft-cli"
STEPS, LOSE_AFTER, HOLD_AT = 20, 5, 14
HEARTBEAT_TIMEOUT = 2.0
# Long beside the heartbeat timeout: a survivor that waited for one would fail the gap check.
PATIENT_TIMEOUT = 40.0
# A hung group's collectives time out this soon, and it leaves the job.
HUNG_GROUP_TIMEOUT = 6.0
# Shorter than a hung group takes to leave: the survivor's quorum times out while it is there.
SHORT_QUORUM_TIMEOUT = 3.0
# What the survivor may take beyond the lighthouse's timeouts to go on alone: a failed try, the
# retry and a step, on two busy cores.
SLACK = 12.0
WAIT = 240.0


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    address: str
    lighthouse: str
    log: Path


# Where the hold plugin's dist-info lies (set once per module by `hold_plugin_site`).
PLUGIN_SITE: list[Path] = []


def _env(marks: Path | None = None, **extra: str) -> dict[str, str]:
    if marks is not None:
        extra["PLAIT_TEST_MARKS"] = str(marks)
    return plugin_env(PLUGIN_SITE, **extra)


@pytest.fixture(scope="module", autouse=True)
def hold_plugin_site(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The hold plugin's dist-info, where `importlib.metadata` finds it on `PYTHONPATH`."""
    PLUGIN_SITE[:] = [install_hold_plugin(tmp_path_factory.mktemp("site"))]


def _plait(*args: str) -> list[str]:
    return [sys.executable, "-m", "plait.tools.cli", *args]


def _wait(condition: Callable[[], bool], what: str, *, log: Path | None = None) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for {what}" + (f":\n{log.read_text()}" if log else "")
            )
        time.sleep(0.1)


def _start_daemon(tmp_path: Path) -> Daemon:
    log = tmp_path / "daemon.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            _plait("daemon", "--bind", "127.0.0.1:0", "--no-calibrate", "--stale-floor", "3",
                   "--lighthouse", "127.0.0.1:0",
                   "--lighthouse-heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                   "--lighthouse-join-timeout", "120"),
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=_env(),
        )  # fmt: skip
    found: dict[str, str] = {}

    def both_addresses() -> bool:
        text = log.read_text()
        assert process.poll() is None, text
        daemon = re.search(r"listening on (\S+:\d+)", text)
        lighthouse = re.search(r"lighthouse on (\S+:\d+)", text)
        if daemon and lighthouse:
            found.update(daemon=daemon.group(1), lighthouse=lighthouse.group(1))
        return len(found) == 2

    _wait(both_addresses, "the daemon's addresses", log=log)
    return Daemon(process, found["daemon"], found["lighthouse"], log)


class Group:
    """One `plait train` replica group (2 ranks), its output in a file."""

    def __init__(
        self, name: str, tmp_path: Path, daemon: Daemon, *, group: int, layout: str,
        sets: tuple[str, ...] = (), holds: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        self.marks = tmp_path / name
        self.marks.mkdir()
        self.output = tmp_path / f"{name}.log"
        command = _plait("train", "configs/tiny.toml", "--nproc-per-node", "2")
        for item in (
            f"parallel.dp_strategy={layout}", f"fault_tolerance.replica_group={group}",
            "fault_tolerance.replica_groups=2", f"fault_tolerance.lighthouse={daemon.lighthouse}",
            f"telemetry.daemon={daemon.address}", f"telemetry.job_id={JOB}",
            f"train.run_dir={self.marks / 'run'}", "train.log_every=1", f"train.steps={STEPS}",
            *sets,
        ):  # fmt: skip
            command += ["--set", item]
        extra = {"PLAIT_TEST_HOLD": ",".join(map(str, holds))}
        with self.output.open("w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                env=_env(self.marks, **extra),
            )  # fmt: skip

    def held(self, step: int) -> bool:
        return all((self.marks / f"held.{step}.rank{r}").exists() for r in (0, 1))

    def release(self, step: int) -> None:
        (self.marks / f"go.{step}").write_text("")

    def text(self) -> str:
        return self.output.read_text()

    def finish(self) -> int:
        try:
            return self.process.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"{self.output.name} never finished:\n{self.text()}") from None

    def steps_logged(self) -> list[int]:
        return [int(n) for n in re.findall(rf"^step (\d+)/{STEPS} ", self.text(), re.M)]

    def losses(self) -> dict[int, float]:
        found = re.findall(rf"^step (\d+)/{STEPS} loss (\S+) ", self.text(), re.M)
        return {int(n): float(v) for n, v in found}

    def step_marks(self, rank: int) -> list[str]:
        path = self.marks / f"rank{rank}.steps"
        return path.read_text().splitlines() if path.exists() else []


def _status(daemon: Daemon) -> dict:
    result = subprocess.run(
        _plait("status", "--json", "--job", JOB, "--host", daemon.address),
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def _groups(document: dict) -> list[tuple[int, str]]:
    jobs = [j for j in document["fault_tolerance"] if j["job_id"] == JOB]
    if not jobs:
        return []
    (job,) = jobs
    return [(g["replica_group"], g["state"]) for g in job["groups"]]


def _largest_gap(marks: list[str]) -> float:
    """The longest time between two step ends of a rank, the test's own holds left out."""
    largest, last = 0.0, None
    for line in marks:
        kind, _, moment = line.split()
        if last is not None and kind != "released":
            largest = max(largest, float(moment) - last)
        last = float(moment)  # after a hold, measure from its release
    return largest


def _lose_a_rank(
    tmp_path: Path, *, layout: str, fault: str, refuse_lone_replacement: bool = False
) -> None:
    daemon = _start_daemon(tmp_path)
    hung = fault == "SIGSTOP"
    timeouts = (
        f"fault_tolerance.step_timeout_seconds={PATIENT_TIMEOUT}",
        f"fault_tolerance.quorum_timeout_seconds={PATIENT_TIMEOUT}",
    )
    survivor_timeouts = timeouts
    lost_timeouts = timeouts
    if hung:
        # The hung group's other rank waits in a collective with the stopped one: it gives up
        # after train.collective_timeout_seconds and the group leaves. Until then the group
        # heartbeats and the lighthouse waits for it, longer than the survivor's quorum timeout:
        # the survivor asks again instead of ending.
        lost_timeouts = (f"train.collective_timeout_seconds={HUNG_GROUP_TIMEOUT}",)
        survivor_timeouts = (
            f"fault_tolerance.step_timeout_seconds={PATIENT_TIMEOUT}",
            f"fault_tolerance.quorum_timeout_seconds={SHORT_QUORUM_TIMEOUT}",
        )
    injected = (
        f"resilience.fault_injection.kill_after_step={LOSE_AFTER}",
        "resilience.fault_injection.rank=1",
        f"resilience.fault_injection.signal={fault}",
    )
    try:
        # Group 0 trains a first step alone and holds; group 1 asks for its first quorum, and
        # both train together from step 2 on (group 1 healed to step 1).
        survivor = Group("group0", tmp_path, daemon, group=0, layout=layout,
                         sets=survivor_timeouts, holds=(1, HOLD_AT))  # fmt: skip
        _wait(lambda: survivor.held(1), "group 0's first step", log=survivor.output)
        lost = Group("group1", tmp_path, daemon, group=1, layout=layout,
                     sets=lost_timeouts + injected)  # fmt: skip
        _wait(lambda: read_lighthouse(daemon.lighthouse).waiting >= 1,
              "group 1 to ask for a quorum", log=lost.output)  # fmt: skip
        survivor.release(1)
        if hung:
            _wait(
                lambda: "stops itself (SIGSTOP" in lost.text(), "the stopped rank", log=lost.output
            )
            stopped = int(re.search(r"SIGSTOP, pid (\d+)", lost.text()).group(1))  # type: ignore[union-attr]
            # Once the survivor trains alone, clear the hung rank away as an operator would
            # (torchrun would SIGKILL it 30 s after its sibling left).
            _wait(lambda: LOSE_AFTER + 2 in survivor.steps_logged(), "the survivor alone",
                  log=survivor.output)  # fmt: skip
            os.kill(stopped, signal.SIGKILL)
        lost_code = lost.finish()
        _wait(lambda: survivor.held(HOLD_AT), "the survivor at its hold", log=survivor.output)
        # While it trains alone: the daemon shows both groups, group 1 gone.
        _wait(lambda: _groups(_status(daemon)) == [(0, "participating"), (1, "left")],
              "plait status to show group 1 left")  # fmt: skip
        replacement = Group("replacement", tmp_path, daemon, group=1, layout=layout,
                            sets=timeouts)  # fmt: skip
        _wait(lambda: read_lighthouse(daemon.lighthouse).waiting >= 1,
              "the replacement to ask for a quorum", log=replacement.output)  # fmt: skip
        survivor.release(HOLD_AT)
        survivor_code, replacement_code = survivor.finish(), replacement.finish()
        if refuse_lone_replacement:
            lone = Group("lone", tmp_path, daemon, group=1, layout=layout, sets=timeouts)
            lone_code = lone.finish()
    finally:
        daemon.process.send_signal(signal.SIGTERM)
        daemon.process.wait(timeout=60)

    assert survivor_code == 0, survivor.text()
    assert replacement_code == 0, replacement.text()
    # The lost group failed with its own report, printed as text (Gloo's `[/path.cc:N]` in it).
    assert lost_code != 0, lost.text()
    assert "training failed:" in lost.text() and "MarkupError" not in lost.text(), lost.text()
    # The survivor: the same two worker processes from the first step to the last, every step
    # logged, and no wait for the dead group beyond the lighthouse's heartbeat timeout.
    for rank in (0, 1):
        marks = survivor.step_marks(rank)
        assert len({line.split()[1] for line in marks}) == 1, marks
        assert int(marks[-1].split()[0]) == STEPS, marks
    assert survivor.steps_logged() == list(range(1, STEPS + 1)), survivor.text()
    gone_after = HUNG_GROUP_TIMEOUT + HEARTBEAT_TIMEOUT if hung else HEARTBEAT_TIMEOUT
    gap = _largest_gap(survivor.step_marks(0))
    print(f"{layout} {fault}: the survivor's longest time between two steps {gap:.2f} s")
    assert gap < min(gone_after + SLACK, PATIENT_TIMEOUT), (gap, survivor.step_marks(0))
    assert "a replica group left (2 -> 1 replica groups)" in survivor.text(), survivor.text()
    # The replacement healed from the survivor: it begins past the hold, at a trained loss.
    assert "healed from a live peer" in replacement.text(), replacement.text()
    first_step = replacement.steps_logged()[0]
    assert first_step > HOLD_AT, replacement.text()
    assert replacement.steps_logged()[-1] == STEPS
    initial_loss = survivor.losses()[1]
    assert replacement.losses()[first_step] < 0.8 * initial_loss, (
        replacement.losses(), initial_loss,
    )  # fmt: skip
    if refuse_lone_replacement:
        # Every group gone, a fresh group 1 with no checkpoint: refused, not trained from scratch.
        assert lone_code != 0, lone.text()
        # The lighthouse's last quorum was the one before the last step.
        assert f"job {JOB!r} had trained {STEPS - 1} steps" in lone.text(), lone.text()
        assert "no live replica group is left" in lone.text(), lone.text()
        assert lone.steps_logged() == [], lone.text()


def test_zero1_group_loses_a_rank_the_survivor_trains_on_and_a_replacement_heals(
    tmp_path: Path,
) -> None:
    _lose_a_rank(tmp_path, layout="zero1", fault="SIGKILL", refuse_lone_replacement=True)


def test_zero3_group_loses_a_rank(tmp_path: Path) -> None:
    _lose_a_rank(tmp_path, layout="zero3", fault="SIGKILL")


def test_ddp_group_with_a_hung_rank(tmp_path: Path) -> None:
    _lose_a_rank(tmp_path, layout="ddp", fault="SIGSTOP")
