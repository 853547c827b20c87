"""What an operator sees of a job's checkpoints: `plait train` on two Gloo ranks saving every 2
steps in the background, its telemetry sent to a real daemon, then `plait status --json --host`
and `plait status --host` name the last save's step, its timing and its size.

No sleep orders anything: the daemon is polled, with a deadline, until the job's last save
arrived (the ranks send it as their telemetry shuts down, before `plait train` exits).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plait.daemon.server import DaemonServer

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PLAIT = [sys.executable, "-m", "plait.tools.cli"]
JOB = "ckpt-status"
STEPS, EVERY = 6, 2


def _plait(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200")
    return subprocess.run(
        [*PLAIT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


@pytest.fixture
def daemon() -> Iterator[DaemonServer]:
    server = DaemonServer("127.0.0.1:0", host_interval=0.2).start()
    try:
        yield server
    finally:
        server.stop(grace=0.5)


def _job_checkpoints(address: str) -> dict[str, Any] | None:
    result = _plait("status", "--json", "--all", "--host", address, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = [j for j in json.loads(result.stdout)["jobs"] if j["job_id"] == JOB]
    return jobs[0]["checkpoints"] if jobs else None


def test_plait_status_shows_the_last_checkpoint_of_a_training_job(
    tmp_path: Path, daemon: DaemonServer
) -> None:
    ckpt = tmp_path / "ckpt"
    trained = _plait(
        "train", "configs/tiny.toml", "--nproc-per-node", "2",
        "--set", f"train.steps={STEPS}", "--set", "train.global_batch_size=4",
        "--set", "data.seq_len=32",
        "--set", f"checkpoint_io.dir={ckpt}", "--set", f"checkpoint_io.every={EVERY}",
        "--set", f"telemetry.daemon={daemon.address}", "--set", f"telemetry.job_id={JOB}",
        timeout=240,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout + trained.stderr

    deadline = time.monotonic() + 60
    checkpoints = _job_checkpoints(daemon.address)
    while not (checkpoints and checkpoints["last"] and checkpoints["last"]["step"] == STEPS):
        assert time.monotonic() < deadline, f"the last save never arrived: {checkpoints}"
        time.sleep(0.2)
        checkpoints = _job_checkpoints(daemon.address)

    last = checkpoints["last"]
    assert (last["outcome"], last["asynchronous"], last["error"]) == ("saved", True, "")
    assert checkpoints["saves"] == STEPS // EVERY and checkpoints["failed"] == 0
    assert checkpoints["writing"] is None  # the job finished: nothing is being written
    assert last["write_seconds"] > 0 and last["blocked_seconds"] > 0
    assert last["end_unix_nano"] > last["start_unix_nano"] > 0
    # The bytes are the files both ranks wrote (the manifest aside), as published.
    files = sorted((ckpt / f"step-{STEPS:08d}").iterdir())
    assert last["bytes"] == sum(f.stat().st_size for f in files if f.name != "manifest.json")
    assert any(f.name.startswith("__1_") for f in files)  # rank 1's part is counted too

    text = _plait("status", "--all", "--host", daemon.address, timeout=60)
    assert text.returncode == 0, text.stdout + text.stderr
    assert re.search(
        rf"checkpoint: step {STEPS} saved in [\d.]+ s \(asynchronous, [\d.]+ MB, the step "
        r"waited [\d.]+ s\), [\d.]+ s ago",
        text.stdout,
    ), text.stdout
