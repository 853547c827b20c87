"""MoE checkpoints reshard across expert-parallel degrees: expert tensors are declared as rows of
the global stacked tensor, so ep2 saves and ep1 (experts replicated) resumes, and back, with the
losses of an uninterrupted ep2 run. The routing bias of loss-free balancing is saved with them
(it is on and moves every step): a resume that lost it would route differently."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from plait.testing.distributed import run_distributed
from tests.dist.moe_workers import train_resume_save

pytestmark = pytest.mark.dist

TIMEOUT = 240.0
STEPS = 4
TOL = 1e-4


def _run(ep: int, ckpt: Path, *, save_at: int = 0, resume: bool = False) -> list[dict]:
    return run_distributed(
        train_resume_save, 2, ep, str(ckpt), STEPS, save_at, resume, timeout=TIMEOUT
    )


def test_ep2_to_ep1_to_ep2(tmp_path: Path) -> None:
    uninterrupted = _run(2, tmp_path / "ep2", save_at=2)
    shutil.copytree(tmp_path / "ep2", tmp_path / "ep1")
    ep1 = _run(1, tmp_path / "ep1", save_at=3, resume=True)
    back = _run(2, tmp_path / "ep1", resume=True)
    assert [r["start"] for r in ep1] == [2, 2] and [r["start"] for r in back] == [3, 3]
    assert ep1[0]["expert_numel"] == 2 * uninterrupted[0]["expert_numel"]  # whole vs half
    reference = uninterrupted[0]["losses"]
    for step in (2, 3):
        assert abs(ep1[0]["losses"][step] - reference[step]) <= TOL, (step, ep1, reference)
    assert abs(back[0]["losses"][3] - reference[3]) <= TOL
    # Every run ends at the same step: the bias it ends with is the uninterrupted run's.
    final_bias = uninterrupted[0]["bias"]
    assert any(any(b != 0 for b in layer) for layer in final_bias), final_bias
    for run in (ep1, back):
        for got, expected in zip(run[0]["bias"], final_bias, strict=True):
            assert got == pytest.approx(expected, abs=1e-6), (got, expected)
