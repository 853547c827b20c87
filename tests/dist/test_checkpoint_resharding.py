"""Resharding on load: a checkpoint saved under one parallel layout resumes under another and
continues with the losses of the run that saved it (weights and Adam state carried over)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from plait.core.testing import run_distributed
from tests.dist import resharding_workers

pytestmark = pytest.mark.dist

STEPS, SAVE_AT = 5, 2
# Different layouts sum gradients and split matmuls in different orders.
TOL = 1e-5


def save_then_resume(
    tmp_path: Path, saver: str, saver_ranks: int, loader: str, loader_ranks: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    train = resharding_workers.train_on_layout
    saved = run_distributed(
        train, saver_ranks, saver, str(tmp_path), STEPS, (SAVE_AT,), False, timeout=150
    )
    resumed = run_distributed(train, loader_ranks, loader, str(tmp_path), STEPS, (), True,
                              timeout=150)  # fmt: skip
    return saved, resumed


def assert_continues(saved: list[dict[str, Any]], resumed: list[dict[str, Any]]) -> None:
    reference = saved[0]["losses"]
    assert sorted(reference) == list(range(STEPS))
    for result in resumed:
        assert result["start"] == SAVE_AT
        assert sorted(result["losses"]) == list(range(SAVE_AT, STEPS))
        for step in range(SAVE_AT, STEPS):
            torch.testing.assert_close(
                result["losses"][step], reference[step], rtol=TOL, atol=TOL,
                msg=lambda m, s=step: f"step {s}: {m}",
            )  # fmt: skip


def test_dp2_to_tp2(tmp_path: Path) -> None:
    """DDP on 2 ranks saves whole tensors; 2-way Megatron TP loads its column/row/vocab slices
    (and the grouped-query KV projection, replicated because tp exceeds its one KV head)."""
    saved, resumed = save_then_resume(tmp_path, "ddp", 2, "tp2", 2)
    assert all(r["degrees"]["tp"] == 2 and "megatron" in r["runtimes"] for r in resumed)
    assert resumed[0]["local_numel"] < saved[0]["local_numel"]
    assert_continues(saved, resumed)


def test_zero3_to_pp2(tmp_path: Path) -> None:
    """ZeRO-3 on 2 ranks saves flat fp32 master shards and their Adam state; a 2-stage 1F1B
    pipeline loads each stage's whole parameters."""
    saved, resumed = save_then_resume(tmp_path, "zero3", 2, "pp2", 2)
    assert all("zero3" in r["runtimes"] for r in saved)
    assert all(r["degrees"]["pp"] == 2 and "pipeline" in r["runtimes"] for r in resumed)
    assert_continues(saved, resumed)
