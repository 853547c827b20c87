"""SIGTERM to `plait train`: every rank finishes its step, a checkpoint is saved, and a resumed
run continues with the losses of a run that was never stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PLAIT = [sys.executable, "-m", "plait.tools.cli"]
STEPS = 16
STEP_LINE = re.compile(r"^step (\d+)/\d+ loss ([\d.]+)", re.MULTILINE)


def _command(checkpoints: Path) -> list[str]:
    # Run records go beside the checkpoints: config.toml and metrics.jsonl.
    return [
        *PLAIT,
        "train",
        "configs/tiny.toml",
        "--nproc-per-node",
        "2",
        "--set",
        f"train.steps={STEPS}",
        "--set",
        "telemetry.enabled=false",
        "--set",
        f"checkpoint_io.dir={checkpoints}",
        "--set",
        "checkpoint_io.every=1000",  # only the stop (and the end) saves
        "--set",
        f"train.run_dir={checkpoints / 'run'}",
        *("--set", "train.log_every=1"),  # a line per step: the test compares every loss
    ]


def _env() -> dict[str, str]:
    return dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200")


def _losses(output: str) -> dict[int, str]:
    return {int(step): loss for step, loss in STEP_LINE.findall(output)}


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_sigterm_saves_and_the_resumed_run_matches_an_uninterrupted_one(tmp_path: Path) -> None:
    stopped = subprocess.Popen(
        _command(tmp_path / "stopped"),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert stopped.stdout is not None
    output = ""
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline:
        line = stopped.stdout.readline()
        if not line:
            break
        output += line
        match = STEP_LINE.match(line)
        if match and int(match.group(1)) >= 3:
            stopped.send_signal(signal.SIGTERM)
            break
    output += stopped.communicate(timeout=120)[0]
    assert stopped.returncode == 128 + signal.SIGTERM, output
    saved = re.search(r"stopped by SIGTERM after step (\d+): checkpoint (\S+)", output)
    assert saved, output
    stop_step = int(saved.group(1))
    assert 3 <= stop_step < STEPS
    assert Path(saved.group(2)).is_dir(), output
    assert "Traceback" not in output, output

    resumed = subprocess.run(
        _command(tmp_path / "stopped"), cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = _losses(resumed.stdout)
    assert min(after) == stop_step + 1, resumed.stdout

    uninterrupted = subprocess.run(
        _command(tmp_path / "whole"), cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert uninterrupted.returncode == 0, uninterrupted.stdout + uninterrupted.stderr
    whole = _losses(uninterrupted.stdout)
    assert {s: whole[s] for s in after} == after

    # The run records cover every step once across the stop and the resume, and the resolved
    # config names the degree the mesh resolved and the DDP defaults the run used.
    run = tmp_path / "stopped" / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert all(line["tokens_per_second"] > 0 and line["loss"] > 0 for line in lines)
    for line in lines:
        assert f"{line['loss']:.4f}" == whole[line["step"]], (line, whole)
    resolved = tomllib.loads((run / "config.toml").read_text())
    assert resolved["parallel"]["dp"] == 2 and resolved["ddp"]["bucket_mb"] == 1.0
