"""SIGKILL of a rank in the middle of an asynchronous checkpoint write, through `plait train`:
the half-written checkpoint is never taken for a complete one, the next run resumes from the
previous checkpoint, and it trains with the losses of the run that was never interrupted there.

The write is stopped by a plugin loaded the way a third party's is (`checkpoint_hold_plugin`):
rank 1 holds inside its data file of checkpoint 4 and says so in a marker file; the test kills
it only then, and only once rank 0 has trained past the save (the save returned at once)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.plugins.checkpoint.storage import LATEST, MANIFEST, list_checkpoints, verify
from tests.e2e.hold_plugin_site import ROOT, plugin_env

STEPS, EVERY, HELD_STEP = 6, 2, 4
WAIT_SECONDS = 150.0


def _install_plugin(site: Path) -> Path:
    info = site / "plait_checkpoint_hold_plugin-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: plait-checkpoint-hold-plugin\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(
        "[plait]\nckpt_hold = tests.e2e.checkpoint_hold_plugin:plugin\n"
    )
    return site


def _command(checkpoints: Path) -> list[str]:
    # `async_save` is left at its default: asynchronous.
    return [
        sys.executable, "-m", "plait.tools.cli", "train", "configs/tiny.toml",
        "--nproc-per-node", "2",
        "--set", f"train.steps={STEPS}",
        "--set", "telemetry.enabled=false",
        "--set", f"checkpoint_io.dir={checkpoints}",
        "--set", f"checkpoint_io.every={EVERY}",
        "--set", "checkpoint_io.keep=0",
    ]  # fmt: skip


def _losses(marks: Path) -> dict[int, str]:
    path = marks / "rank0.losses"
    if not path.is_file():
        return {}
    pairs = (line.split() for line in path.read_text().splitlines() if line.strip())
    return {int(step): loss for step, loss in pairs}


def _wait_for(condition: object, what: str, job: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():  # type: ignore[operator]
        if job.poll() is not None:
            raise AssertionError(f"plait train ended ({job.returncode}) before {what}")
        if time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_sigkill_mid_background_write_resumes_from_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    site = _install_plugin(tmp_path / "site")
    checkpoints, killed_marks, resumed_marks = (
        tmp_path / "ckpt",
        tmp_path / "marks-killed",
        tmp_path / "marks-resumed",
    )
    killed_marks.mkdir()
    resumed_marks.mkdir()
    env = plugin_env(
        [site],
        PLAIT_TEST_MARKS=str(killed_marks),
        PLAIT_TEST_CKPT_HOLD=str(HELD_STEP),
        PLAIT_TEST_CKPT_HOLD_RANK="1",
    )
    job = subprocess.Popen(
        _command(checkpoints), cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    held = killed_marks / f"held.{HELD_STEP}.rank1"
    try:
        _wait_for(held.is_file, f"rank 1 to hold inside checkpoint {HELD_STEP}", job)
        # The save returned at once: training went on to the next save while the write hung.
        _wait_for(lambda: len(_losses(killed_marks)) >= HELD_STEP + EVERY, "step 6", job)
        os.kill(int(held.read_text()), signal.SIGKILL)
        output = job.communicate(timeout=WAIT_SECONDS)[0]
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode != 0, output
    before = _losses(killed_marks)

    # Checkpoint 4 was never published. Its temporary directory is gone if rank 0 saw the
    # write fail before torchrun stopped it (it cleans up), or left without a manifest.
    assert [p.name for p in list_checkpoints(checkpoints)] == ["step-00000002"], output
    assert (checkpoints / LATEST).read_text().strip() == "step-00000002"
    assert verify(checkpoints / "step-00000002").ok
    partial = checkpoints / f".tmp-step-{HELD_STEP:08d}"
    assert not (partial / MANIFEST).exists()

    resumed = subprocess.run(
        _command(checkpoints), cwd=ROOT, text=True, capture_output=True, timeout=WAIT_SECONDS,
        env=plugin_env([site], PLAIT_TEST_MARKS=str(resumed_marks)),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = _losses(resumed_marks)
    assert sorted(after) == list(range(3, STEPS + 1)), resumed.stdout
    # Steps 3 to 6 ran before the kill too, uninterrupted: the same losses, to the last bit.
    assert {step: after[step] for step in range(3, HELD_STEP + EVERY + 1)} == {
        step: before[step] for step in range(3, HELD_STEP + EVERY + 1)
    }
    assert [p.name for p in list_checkpoints(checkpoints)] == [
        "step-00000006",
        "step-00000004",
        "step-00000002",
    ]
    assert not partial.exists()  # the rerun's save of step 4 replaced the stale temporary
