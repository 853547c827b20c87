"""A finished run exits 0: 20 consecutive 2-rank runs with checkpoints, each ending in a real
interpreter exit, with nothing of plait's (Gloo worker threads, background threads) left
running when Python finalizes (see `plait.core.process_groups` for why that aborts)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = 20


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_twenty_finished_runs_all_exit_zero(tmp_path: Path) -> None:
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "tests.e2e.clean_exit_runs", str(RUNS), str(tmp_path)],
        capture_output=True, text=True, timeout=560, cwd=ROOT, env=env,
    )  # fmt: skip
    codes = re.findall(r"^run (\d+) exit codes \[(.*)\]$", result.stdout, re.M)
    assert [int(run) for run, _ in codes] == list(range(RUNS)), result.stdout + result.stderr
    assert all(ranks == "0, 0" for _, ranks in codes), result.stdout
    assert result.returncode == 0, result.stdout + result.stderr
    # Every run trained and checkpointed (the final save is the last step's).
    for run in range(RUNS):
        assert (tmp_path / f"run-{run}" / "latest").read_text().strip() == "step-00000003"
