"""`plait train` for real: torchrun launches two Gloo ranks that train the tiny Llama."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAIT = [sys.executable, "-m", "plait.tools.cli"]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200")
    return subprocess.run(
        [*PLAIT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_train_two_ranks_loss_falls() -> None:
    result = _run(
        [
            "train",
            "configs/tiny.toml",
            "--nproc-per-node",
            "2",
            "--set",
            "train.steps=8",
            "--set",
            "telemetry.enabled=false",
        ],
        timeout=220,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 ranks (pp=1 dp=2 cp=1 tp=1)" in result.stdout
    assert "MFU" in result.stdout
    done = re.search(r"done: loss ([\d.]+) → ([\d.]+)", result.stdout)
    assert done, result.stdout
    first, last = map(float, done.groups())
    assert last < first - 0.2, f"loss did not fall: {first} → {last}"


def test_train_rejects_bad_config_before_launching() -> None:
    result = _run(["train", "configs/tiny.toml", "--set", "parallel.dp_strategy=zero9"], timeout=60)
    assert result.returncode == 2
    assert "zero9" in result.stdout and "ddp" in result.stdout
    assert "torch.distributed" not in result.stderr  # nothing was launched


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_demo_runs_with_the_daemon() -> None:
    result = _run(["demo", "--steps", "10"], timeout=220)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "node daemon on 127.0.0.1:" in result.stdout
    assert "what the daemon saw" in result.stdout
    assert re.search(r"2/2 .*\d+\.\d%", result.stdout), "the daemon's job table shows 2 ranks"
