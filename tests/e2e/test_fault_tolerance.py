"""A rank is SIGKILLed mid-run; torchrun restarts the job, which resumes from the last checkpoint
and finishes with the losses of an uninterrupted run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, KILL_AFTER = 8, 2, 5


def _torchrun(ckpt_dir: Path, kill_after: int, max_restarts: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
               "-m", "tests.e2e.fault_tolerance_worker",
               str(ckpt_dir), str(STEPS), str(EVERY), str(kill_after)]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=200, cwd=ROOT, env=env)


def _losses(stdout: str) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, v in re.findall(r"^step (\d+) loss (\S+)$", stdout, re.M)]


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_sigkilled_rank_restarts_and_resumes(tmp_path: Path) -> None:
    killed = _torchrun(tmp_path / "killed", KILL_AFTER, max_restarts=1)
    output = killed.stdout + killed.stderr
    assert killed.returncode == 0, output
    assert f"rank 1 kills itself after step {KILL_AFTER}" in output
    starts = re.findall(r"^start (\d+)$", killed.stdout, re.M)
    # First attempt from scratch; the restart from the checkpoint before the kill (step 4).
    assert starts == ["0", str(KILL_AFTER // EVERY * EVERY)], output
    losses = _losses(killed.stdout)
    steps = [s for s, _ in losses]
    # Printed steps are 1-based: the restart resumes after checkpoint step 4, replaying step 5.
    replay_from = KILL_AFTER // EVERY * EVERY + 1
    assert steps[-1] == STEPS and steps.count(replay_from) == 2, steps
    restart_index = steps.index(replay_from, steps.index(replay_from) + 1)
    first, replayed = dict(losses[:restart_index]), dict(losses[restart_index:])
    # Steps replayed after the restart give exactly the losses of the first attempt.
    for step in set(first) & set(replayed):
        assert replayed[step] == first[step], (step, first[step], replayed[step])
    straight = _torchrun(tmp_path / "straight", -1, max_restarts=0)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    assert dict(_losses(straight.stdout))[STEPS] == replayed[STEPS]
    assert (tmp_path / "killed" / "latest").read_text().strip() == f"step-{STEPS:08d}"


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_plait_train_max_restarts_resumes(tmp_path: Path) -> None:
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200")
    sets = ["train.steps=6", "telemetry.enabled=false", f"checkpoint_io.dir={tmp_path}",
            "checkpoint_io.every=2", "checkpoint_io.fault_injection.kill_after_step=3",
            "checkpoint_io.fault_injection.rank=1"]  # fmt: skip
    command = [sys.executable, "-m", "plait.tools.cli", "train", "configs/tiny.toml",
               "--nproc-per-node", "2", "--max-restarts", "1"]  # fmt: skip
    for item in sets:
        command += ["--set", item]
    result = subprocess.run(command, capture_output=True, text=True, timeout=220, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kills itself after step 3" in result.stderr
    assert "step 6/6" in result.stdout
    assert (tmp_path / "latest").read_text().strip() == "step-00000006"
