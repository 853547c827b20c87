"""Two `plait train` launchers on loopback, each seeing only its node's Slurm variables, form
one job and train it — nothing but the allocation tells them about each other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.free_ports import unassigned_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_two_nodes_form_a_job_from_slurm_variables_alone() -> None:
    port = unassigned_port()
    launchers = []
    for node in range(2):
        env = dict(
            os.environ,
            PLAIT_DISABLE_PLUGIN_AUTOLOAD="1",
            COLUMNS="200",
            SLURM_JOB_ID=f"plait-test-{port}",
            SLURM_NNODES="2",
            SLURM_NODEID=str(node),
            SLURM_JOB_NODELIST="127.0.0.1",
        )
        command = [
            sys.executable,
            "-m",
            "plait.tools.cli",
            "train",
            "configs/tiny.toml",
            "--rdzv-port",
            str(port),
            "--set",
            "train.steps=3",
            "--set",
            "telemetry.enabled=false",
        ]
        launchers.append(
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [launcher.communicate(timeout=280)[0] for launcher in launchers]
    for node, (launcher, output) in enumerate(zip(launchers, outputs, strict=True)):
        assert launcher.returncode == 0, output
        assert f"node {node} of 2, rendezvous at 127.0.0.1:{port}" in output, output
    # Rank 0 (on one of the two nodes) reports the two-rank job it trained.
    assert any("2 ranks (pp=1 dp=2" in output for output in outputs), outputs
