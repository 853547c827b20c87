"""A rank of a replica group that lost a sibling leaves at once on torchrun's SIGTERM (its
manager stops heartbeating, so the lighthouse drops the group); with every sibling alive the
signal keeps its graceful meaning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_agent(mode: str) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    result = subprocess.run(
        [sys.executable, "-m", "tests.dist.group_loss_agent", mode],
        capture_output=True, text=True, timeout=180, cwd=ROOT, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.timeout(200)
def test_a_rank_whose_sibling_died_leaves_on_the_agents_sigterm() -> None:
    worker = _run_agent("dead")
    # Blocked where the handler cannot end it, the rank still left: only the watcher did that.
    assert worker["code"] == 1, worker
    assert "replica group 1 lost a rank on this node; leaving the job now" in worker["err"]
    assert "graceful" not in worker["out"]


@pytest.mark.timeout(200)
def test_a_sigterm_with_every_sibling_alive_stays_a_graceful_stop() -> None:
    worker = _run_agent("alive")
    assert worker["code"] == 0, worker
    assert "graceful stop after [15]" in worker["out"], worker
    assert "leaving the job" not in worker["err"]
