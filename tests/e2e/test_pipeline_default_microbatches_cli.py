"""`plait train` with `parallel.pp = 2` and no `train.micro_batch_size`: two Gloo ranks train the
tiny Llama, and the banner says how each rank's batch was split and why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_pp_alone_trains_and_the_banner_names_the_chosen_micro_batches(tmp_path: Path) -> None:
    tiny = (ROOT / "configs" / "tiny.toml").read_text()
    config = tmp_path / "tiny_pp.toml"
    config.write_text(
        "\n".join(line for line in tiny.splitlines() if "micro_batch_size" not in line)
    )
    env = dict(os.environ, PLAIT_DISABLE_PLUGIN_AUTOLOAD="1", COLUMNS="200")
    args = ["train", str(config), "--nproc-per-node", "2", "--set", "parallel.pp=2"]
    args += ["--set", "train.steps=2", "--set", "telemetry.enabled=false"]
    result = subprocess.run(
        [sys.executable, "-m", "plait.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 ranks (pp=2 dp=1 cp=1 tp=1)" in result.stdout
    # global_batch_size = 8 on one data-parallel replica: 8 rows, the first count >= 2 x pp is 4.
    assert (
        "micro-batches: 4 of 2 rows per rank per step (train.micro_batch_size unset: chosen "
        "for schedule 1f1b with pp=2" in result.stdout
    ), result.stdout
    assert "step 2/2 loss" in result.stdout, result.stdout
