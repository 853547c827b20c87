"""Resharding on load: a checkpoint saved under one parallel layout resumes under another and
continues with the losses of the run that saved it (weights and Adam state carried over)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.testing.distributed import run_distributed
from tests.dist import resharding_workers

pytestmark = pytest.mark.dist

STEPS = 5
# Layouts sum gradients and split matmuls in different orders: equal up to rounding.
TOL = 1e-5


def train(
    layout: str, ranks: int, ckpt_dir: Path, *, save_at: int | None = None, n_layers: int = 2
) -> list[dict[str, Any]]:
    """`STEPS` steps on `layout`, resuming from `ckpt_dir`'s latest checkpoint if it has one."""
    resume = any(ckpt_dir.glob("step-*"))
    saves = (save_at,) if save_at is not None else ()
    return run_distributed(
        resharding_workers.train_on_layout, ranks, layout, str(ckpt_dir), STEPS, saves, resume,
        n_layers, timeout=150,
    )  # fmt: skip


def assert_continues(saver: list[dict[str, Any]], loader: list[dict[str, Any]], at: int) -> None:
    """Every rank of `loader` resumed at `at` and matches the saving run's losses from there."""
    reference = saver[0]["losses"]
    for result in loader:
        assert result["start"] == at
        assert sorted(result["losses"]) == list(range(at, STEPS))
        for step in range(at, STEPS):
            torch.testing.assert_close(
                result["losses"][step], reference[step], rtol=TOL, atol=TOL,
                msg=lambda m, s=step: f"step {s}: {m}",
            )  # fmt: skip


def test_ddp_to_tp2_to_zero2(tmp_path: Path) -> None:
    """DDP on 2 ranks saves whole tensors at step 2; 2-way Megatron TP resumes with its
    column/row/vocab slices (and the grouped-query KV projection, replicated because tp exceeds
    its one KV head) and saves them at step 3; ZeRO-2 on 2 ranks resumes from the slices into
    its flat fp32 master shards and Adam state, and all-gathers its flat parameter buffers. The
    4 -> 2 rank case is `test_checkpoint.py::test_reshard_dp4_to_dp2_to_dp1`."""
    ddp_dir, tp_dir = tmp_path / "ddp", tmp_path / "tp"
    ddp = train("ddp", 2, ddp_dir, save_at=2)
    shutil.copytree(ddp_dir, tp_dir)
    tp = train("tp2", 2, tp_dir, save_at=3)
    zero2 = train("zero2", 2, tp_dir)

    assert all(r["degrees"]["tp"] == 2 and "megatron" in r["runtimes"] for r in tp)
    assert tp[0]["local_numel"] < ddp[0]["local_numel"]
    assert all("zero2" in r["runtimes"] for r in zero2)
    assert_continues(ddp, tp, at=2)
    assert_continues(tp, zero2, at=3)


def test_zero3_to_interleaved_pp2(tmp_path: Path) -> None:
    """ZeRO-3 on 2 ranks saves per-block flat shards; a 2-rank pipeline with two chunks per rank
    (interleaved 1F1B) loads each chunk's parameters under their original names."""
    zero3 = train("zero3", 2, tmp_path, save_at=2, n_layers=4)
    pipeline = train("pp2_interleaved", 2, tmp_path, n_layers=4)

    assert all("zero3" in r["runtimes"] for r in zero3)
    assert all(r["degrees"]["pp"] == 2 and "pipeline" in r["runtimes"] for r in pipeline)
    assert_continues(zero3, pipeline, at=2)


def test_hf_export_from_tp2_imports_into_zero2(tmp_path: Path) -> None:
    """HF export and import of a running job go through the declared layout: tp slices are
    assembled into whole tensors, and ZeRO-2 ranks read the flat ranges they hold."""
    from safetensors.torch import load_file

    from plait.plugins.huggingface.weights import hf_to_plait_name

    ranks = run_distributed(resharding_workers.hf_export_then_import, 2, str(tmp_path), timeout=150)
    exported = {
        hf_to_plait_name(k): v for k, v in load_file(str(tmp_path / "model.safetensors")).items()
    }
    assert not (tmp_path / ".plait-export").exists()
    for result in ranks:
        assert result["loaded"] == len(exported) == len(result["after"])
        assert any(not torch.equal(result["before"][n], v) for n, v in exported.items())
        for name, value in exported.items():
            assert torch.equal(result["after"][name], value), name
