"""Compiled blocks under ZeRO-3 and HSDP: they train like eager blocks on two Gloo ranks (with
activation checkpointing, and with inductor) and as pipeline stages (pp = 2 × ZeRO-3 on four),
ZeRO-3's gather and reshard hooks stay outside the graph (no graph break, no recompile), and
what the compiler did is summarised once, a later recompilation reported with its cause."""

from __future__ import annotations

import pytest
import torch

from plait.testing.distributed import run_distributed
from tests.dist import compile_workers, compile_zero3_workers
from tests.dist.precision_workers import GLOBAL_BATCH

pytestmark = pytest.mark.dist

STEPS = 4
BLOCKS = 2
MICRO_BATCHES = 2
# Each of the 2 ranks' share of the global batch, in MICRO_BATCHES micro-batches.
MICRO_BATCH = GLOBAL_BATCH // (2 * MICRO_BATCHES)
COUNTING = {"backend": compile_workers.COUNTING_BACKEND}
HSDP = {"dp_shard": 1}  # two replicas of a one-rank shard group: the replica average runs


def _assert_same_training(got: dict, want: dict, tol: float, what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=tol, atol=tol, msg=what
    )
    assert got["params"].keys() == want["params"].keys(), f"{what}: parameter names changed"
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=tol, atol=tol, msg=name)


def _assert_compiled_cleanly(result: dict, what: str) -> None:
    # Dynamo traced no collective: a hook traced into the block would break the graph at the
    # all-gather and recompile as the communicator's counters move.
    assert result["graph_breaks"] == {}, f"{what}: {list(result['graph_breaks'])}"
    assert result["recompile_reasons"] == [], f"{what}: {result['recompile_reasons']}"
    # Every block's forward runs its graph, every micro-batch of every step.
    assert result["graph_calls"] >= BLOCKS * MICRO_BATCHES * STEPS, what
    graphs = result["graphs_after_step"]
    # One graph serves both blocks, compiled in step 1; nothing compiles after step 2.
    assert 1 <= graphs[0] <= 2 and graphs[-1] == graphs[1], f"{what}: {graphs}"
    (summary,) = result["watch"]
    assert f"for {BLOCKS} blocks, 0 graph breaks" in summary, summary


@pytest.mark.timeout(600)
def test_compiled_zero3_and_hsdp_train_like_eager() -> None:
    torch.manual_seed(0)
    ac = {"checkpoint": {"mode": "full"}}
    runs = {
        "zero3": {"dp": "zero3"},
        "zero3 compiled": {"dp": "zero3", "compile": COUNTING},
        "zero3+ac": {"dp": "zero3", **ac},
        "zero3+ac compiled": {"dp": "zero3", **ac, "compile": COUNTING},
        "hsdp": {"dp": "zero3", "parallel": HSDP},
        "hsdp compiled": {"dp": "zero3", "parallel": HSDP, "compile": COUNTING},
    }
    results = run_distributed(compile_zero3_workers.train, 2, runs, STEPS, MICRO_BATCH, timeout=540)
    for rank, result in enumerate(results):
        for eager in ("zero3", "zero3+ac", "hsdp"):
            compiled = f"{eager} compiled"
            # The graph runs the same aten ops as eager, in the same order.
            _assert_same_training(result[compiled], result[eager], 1e-4, f"rank {rank} {compiled}")
            assert result[eager]["graph_calls"] == 0 and result[eager]["watch"] is None
            _assert_compiled_cleanly(result[compiled], f"rank {rank} {compiled}")
            assert "compiled blocks compile (plait_test_counting)" in result[compiled]["banner"]
        # HSDP: each rank a replica of a one-rank shard group, averaged across the two.
        assert result["hsdp compiled"]["replicas"] == 2
    assert results[0]["zero3 compiled"]["losses"] == results[1]["zero3 compiled"]["losses"]


@pytest.mark.timeout(300)
def test_pipeline_stages_under_zero3_compile_like_eager() -> None:
    """pp = 2 × ZeRO-3 over dp = 2 (4 ranks, 1F1B): each stage's one block compiles once, with no
    break and no recompile, and trains exactly as its eager twin."""
    pipeline = {"dp": "zero3", "parallel": {"pp": 2}, "schedule": {"name": "1f1b"}}
    runs = {"eager": pipeline, "compiled": {**pipeline, "compile": COUNTING}}
    micro_batch = GLOBAL_BATCH // (4 * MICRO_BATCHES)  # 1F1B needs a micro-batch per stage
    results = run_distributed(compile_zero3_workers.train, 4, runs, STEPS, micro_batch, timeout=240)
    for rank, result in enumerate(results):
        eager, compiled = result["eager"], result["compiled"]
        _assert_same_training(compiled, eager, 1e-5, f"rank {rank}")
        assert compiled["graph_breaks"] == {} and compiled["recompile_reasons"] == []
        # A stage holds one of the two blocks: its graph runs once per micro-batch and step.
        assert compiled["graph_calls"] == MICRO_BATCHES * STEPS, compiled["graph_calls"]
        assert compiled["graphs_after_step"] == [1] * STEPS
        assert compiled["watch"] == [compiled["watch"][0]]
        assert "1 graph for 1 block, 0 graph breaks" in compiled["watch"][0]


@pytest.mark.timeout(600)
def test_inductor_under_zero3_trains_like_eager() -> None:
    torch.manual_seed(0)
    runs = {
        "zero3": {"dp": "zero3"},
        "zero3 inductor": {"dp": "zero3", "compile": {"backend": "inductor"}},
    }
    results = run_distributed(compile_zero3_workers.train, 2, runs, STEPS, MICRO_BATCH, timeout=540)
    for rank, result in enumerate(results):
        inductor = result["zero3 inductor"]
        # Generated kernels fuse and reorder float arithmetic: close, not bit-equal.
        _assert_same_training(inductor, result["zero3"], 1e-4, f"rank {rank} inductor")
        assert inductor["graph_breaks"] == {} and inductor["recompile_reasons"] == []
        (summary,) = inductor["watch"]
        assert "0 graph breaks" in summary and "s compiling by step 1" in summary, summary


@pytest.mark.timeout(600)
def test_a_recompilation_after_the_warm_up_is_reported_with_its_cause() -> None:
    torch.manual_seed(0)
    # Step 4 halves the sequence: its static shape guard fails and the block recompiles.
    runs = {"zero3 compiled": {"dp": "zero3", "compile": COUNTING, "shorter_after": 3}}
    results = run_distributed(compile_zero3_workers.train, 2, runs, STEPS, MICRO_BATCH, timeout=540)
    for result in results:
        run = result["zero3 compiled"]
        assert run["graph_breaks"] == {}
        first, recompiled = run["watch"]
        assert "compiling by step 1" in first, first
        assert recompiled.startswith("compiled blocks recompiled in step 4: "), recompiled
        # Dynamo's own guard failure names the dimension that changed.
        assert "size mismatch" in recompiled, recompiled
