"""Checkpoints move between context-parallel degrees: cp holds no parameter shards (every
parameter is replicated over cp in the state layout), so a cp=1 checkpoint resumes on cp=2
and a cp=2 one on cp=1, each continuing with the losses of the run that saved it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from plait.testing.distributed import run_distributed
from tests.dist.cp_workers import checkpoint_round_trip

pytestmark = pytest.mark.dist

STEPS = 5
TOL = 1e-5


@pytest.mark.timeout(300)
def test_cp1_to_cp2_to_cp1(tmp_path: Path) -> None:
    first, second = tmp_path / "cp1", tmp_path / "cp2"
    (cp1,) = run_distributed(checkpoint_round_trip, 1, str(first), STEPS, 2, False, timeout=150)
    shutil.copytree(first, second)
    cp2 = run_distributed(checkpoint_round_trip, 2, str(second), STEPS, 3, True, timeout=150)
    (back,) = run_distributed(checkpoint_round_trip, 1, str(second), STEPS, None, True, timeout=150)

    reference = cp1["losses"]
    assert cp1["cp"] == 1 and sorted(reference) == list(range(STEPS))
    assert all(r["cp"] == 2 and r["start"] == 2 for r in cp2)
    assert back["cp"] == 1 and back["start"] == 3
    for result in (*cp2, back):
        for step, loss in result["losses"].items():
            torch.testing.assert_close(loss, reference[step], rtol=TOL, atol=TOL)
