"""Distributed checkpoints: exact resume, resharding on load, async save, the NaN/Inf guard."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from plait.testing.distributed import run_distributed
from plait.plugins.checkpoint.storage import MANIFEST, list_checkpoints, verify
from tests.dist import checkpoint_workers

pytestmark = pytest.mark.dist

# dp degrees change the order of the gradient sums (an all-reduce of halves vs one sum).
RESHARD_TOL = 1e-5


def test_exact_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    """10 steps straight vs 5 + resume (a fresh process) + 5: bit-identical losses."""
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    train = checkpoint_workers.train_and_checkpoint
    (straight,) = run_distributed(train, 1, str(straight_dir), 10, (), False, timeout=120)
    (first,) = run_distributed(train, 1, str(split_dir), 5, (5,), False, timeout=120)
    (resumed,) = run_distributed(train, 1, str(split_dir), 10, (), True, timeout=120)

    assert first["start"] == 0 and resumed["start"] == 5
    assert sorted(resumed["losses"]) == list(range(5, 10))
    combined = {**first["losses"], **resumed["losses"]}
    assert combined == straight["losses"], "resumed losses differ from the uninterrupted run"
    # The RNG state was restored too: the generator continues exactly where it was.
    assert resumed["rng"] == straight["rng"]
    assert [p.name for p in list_checkpoints(split_dir)] == ["step-00000005"]
    assert (split_dir / "latest").read_text().strip() == "step-00000005"


def test_reshard_dp4_to_dp2_to_dp1(tmp_path: Path) -> None:
    """A checkpoint saved by 4 ranks resumes on 2 (async save there), whose resumes on 1; each
    continues with the losses of the run that saved it."""
    train = checkpoint_workers.train_and_checkpoint
    dp4_dir, dp2_dir = tmp_path / "dp4", tmp_path / "dp2"
    dp4 = run_distributed(train, 4, str(dp4_dir), 6, (3,), False, timeout=150)
    shutil.copytree(dp4_dir, dp2_dir)
    dp2 = run_distributed(train, 2, str(dp2_dir), 8, (6,), True, True, timeout=120)
    (dp1,) = run_distributed(train, 1, str(dp2_dir), 8, (), True, timeout=120)

    assert {r["start"] for r in dp2} == {3} and dp1["start"] == 6
    # Replicated tensors were written once, not once per rank.
    assert len(list((dp4_dir / "step-00000003").glob("__*.distcp"))) <= 4
    for step in (3, 4, 5):
        torch.testing.assert_close(
            dp2[0]["losses"][step], dp4[0]["losses"][step], rtol=RESHARD_TOL, atol=RESHARD_TOL
        )
    for step in (6, 7):
        torch.testing.assert_close(
            dp1["losses"][step], dp2[0]["losses"][step], rtol=RESHARD_TOL, atol=RESHARD_TOL
        )
    assert verify(dp2_dir / "step-00000006").ok


def test_corrupted_checkpoint_falls_back_to_previous(tmp_path: Path) -> None:
    train = checkpoint_workers.train_and_checkpoint
    (first,) = run_distributed(train, 1, str(tmp_path), 4, (2, 4), False, timeout=120)
    newest = tmp_path / "step-00000004"
    data_file = next(newest.glob("__0_*.distcp"))
    with data_file.open("r+b") as f:
        f.truncate(data_file.stat().st_size // 2)
    verdict = verify(newest)
    assert not verdict.ok and "truncated" in verdict.problem
    (resumed,) = run_distributed(train, 1, str(tmp_path), 4, (), True, timeout=120)
    assert resumed["start"] == 2
    assert resumed["losses"] == {k: v for k, v in first["losses"].items() if k >= 2}
    assert (tmp_path / "step-00000002" / MANIFEST).is_file()


def test_nonfinite_guard_skips_then_stops() -> None:
    (result,) = run_distributed(checkpoint_workers.nonfinite_guard, 1, (1, 3, 4), timeout=120)
    # step 1 skipped (parameters untouched), step 2 trains, steps 3 and 4 in a row stop the run.
    assert result["skipped"] == [False, True, False, True]
    assert result["changed"] == [True, False, True, False]
    assert "2 consecutive steps" in result["error"]
    assert "max_consecutive_nonfinite = 2" in result["error"]
