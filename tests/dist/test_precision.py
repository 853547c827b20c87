"""Mixed precision over two DDP ranks: bf16/fp16 track fp32; fp16 overflow skips on every rank."""

from __future__ import annotations

import math

import pytest
import torch

from plait.testing.distributed import run_distributed
from tests.dist import precision_workers

pytestmark = pytest.mark.dist

STEPS = 20
WINDOW = 5  # losses are compared as means over the first / last WINDOW steps (one batch is noisy)
# The tiny Llama's mean loss drops ~0.7 nats over these steps (5.490 -> 4.786 in fp32); the low
# precision runs end at 4.781 (bf16), 4.776 (fp16), 4.793 (bf16 autocast) on torch 2.13 CPU, i.e.
# within 0.01 nats. Allowed: 0.05 nats, ~7% of the drop.
LOSS_MARGIN = 0.05
MIN_PROGRESS = 0.5

RUNS = {
    "fp32": None,
    # bf16 parameters and gradients, fp32 masters; blocks checkpointed (selective).
    "bf16+ac": {"dtype": "bf16"},
    # fp16 parameters and gradients, fp32 masters, dynamic loss scaling.
    "fp16": {"dtype": "fp16"},
    # fp32 parameters under autocast; gradients all-reduced in bf16.
    "bf16-autocast": {"dtype": "bf16", "param_dtype": "fp32", "reduce_dtype": "bf16"},
}


def test_bf16_and_fp16_converge_like_fp32() -> None:
    results = run_distributed(precision_workers.train_losses, 2, RUNS, STEPS, timeout=240)
    rank0, rank1 = results
    for name in RUNS:
        assert rank0[name]["losses"] == rank1[name]["losses"], f"{name}: ranks disagree"
    fp32 = rank0["fp32"]["losses"]
    fp32_final = _mean(fp32[-WINDOW:])
    assert _mean(fp32[:WINDOW]) - fp32_final > MIN_PROGRESS, f"fp32 did not learn: {fp32}"
    for name in ("bf16+ac", "fp16", "bf16-autocast"):
        run = rank0[name]
        assert all(math.isfinite(x) for x in run["losses"]), f"{name}: {run['losses']}"
        final = _mean(run["losses"][-WINDOW:])
        assert abs(final - fp32_final) < LOSS_MARGIN, (
            f"{name}: final mean loss {final:.4f} vs fp32 {fp32_final:.4f}"
        )
    # Low-precision parameters and gradients in the module, fp32 masters in the optimizer.
    for name, dtype in (("bf16+ac", "torch.bfloat16"), ("fp16", "torch.float16")):
        run = rank0[name]
        assert run["param_dtype"] == run["grad_dtype"] == dtype
        assert run["memory"]["master_weights"] == 2 * run["memory"]["parameters"]
        assert run["reduce_casts"] is None  # reduced in the gradients' own dtype
    assert rank0["bf16+ac"]["checkpointed"] == ["0", "1"]
    assert rank0["fp16"]["checkpointed"] is None
    # Autocast keeps fp32 parameters (no masters); its gradients went over the wire in bf16.
    autocast = rank0["bf16-autocast"]
    assert autocast["param_dtype"] == autocast["grad_dtype"] == "torch.float32"
    assert "master_weights" not in autocast["memory"]
    assert autocast["reduce_casts"] > 0
    assert autocast["losses"] != fp32, "autocast must change the arithmetic"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere_and_recovers() -> None:
    amp = {"dtype": "fp16", "initial_scale": 1024.0, "growth_interval": 3}
    results = run_distributed(precision_workers.overflow_recovery, 2, amp, [2], 7, timeout=120)
    # Clean, clean, inf on rank 1 -> skip + back off to 512, then three clean steps grow it back.
    expected_scales = [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
    for rank, result in enumerate(results):
        assert result["skipped"] == [False, False, True, False, False, False, False], rank
        assert result["changed"] == [True, True, False, True, True, True, True], rank
        assert result["scales"] == expected_scales, rank
        assert result["skipped_steps"] == 1
        assert result["state"] == {"scale": 1024.0, "clean_steps": 1, "skipped_steps": 1}
        assert all(math.isfinite(x) for x in result["losses"])
        assert result["losses"][-1] < result["losses"][0]
    torch.testing.assert_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)


# Saved under one data-parallel strategy, resumed under another: the fp32 masters and their
# optimizer state are what a checkpoint holds, whoever keeps them.
RESUMED_LAYOUTS = [("ddp", "ddp"), ("ddp", "zero2"), ("zero2", "ddp"), ("zero3", "ddp")]


def test_resume_with_master_weights_is_bit_exact(tmp_path) -> None:
    """bf16 parameters over fp32 masters under DDP: a resumed job once restored the bf16
    weights but not the masters, and its first optimizer step put the initial weights back
    (seen on an H200: the second resumed loss was the first step's)."""
    ranks = run_distributed(
        precision_workers.resume_with_master_weights, 2, str(tmp_path), RESUMED_LAYOUTS, "bf16",
        timeout=300,
    )  # fmt: skip
    for results in ranks:
        for name, run in results.items():
            saving, resuming = name.split("->")
            if saving == resuming:
                assert run["resumed"] == run["straight"][2:], (name, run)
                continue
            # Another strategy reduces gradients in another order: equal up to bf16 rounding of
            # the step (lost masters put the loss back by ~0.1 nats).
            for got, want in zip(run["resumed"], run["straight"][2:], strict=True):
                assert abs(got - want) < 1e-3, (name, run)
