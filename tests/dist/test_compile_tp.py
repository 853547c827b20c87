"""Compiled blocks under tensor parallelism, with and without sequence parallelism: they train
like eager blocks on two Gloo ranks (tp = 2), the graph breaks only at the tensor-parallel
operators (which run eagerly, the breaks counted in the summary), and nothing recompiles after
the first step — the communicator's counters are never traced. With activation checkpointing the
blocks compile inside their checkpoint wrappers (a checkpoint traced whole cannot break, and
would leave the block eager): every piece runs compiled in forward and again when backward
recomputes it. Which layouts compile at all: tests/unit/test_compile_layouts.py."""

from __future__ import annotations

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import compile_tp_workers, compile_workers
from tests.dist.precision_workers import GLOBAL_BATCH

pytestmark = pytest.mark.dist

STEPS = 5
BLOCKS = 2
MICRO_BATCHES = 2
MICRO_BATCH = GLOBAL_BATCH // MICRO_BATCHES  # dp = 1: each rank takes the whole batch
COUNTING = {"backend": compile_workers.COUNTING_BACKEND}
TP = {"tp": 2}
SP = {"sequence_parallel": True}
AC = {"mode": "full"}
# What Dynamo says when it meets a tensor-parallel operator (calling or inlining it).
DISABLED = "`torch.compiler.disable()`d function"


@pytest.mark.timeout(600)
def test_compiled_blocks_under_tensor_parallelism_train_like_eager() -> None:
    runs = {
        "tp": {"parallel": TP},
        "tp compiled": {"parallel": TP, "compile": COUNTING},
        "tp+sp": {"parallel": TP, "tp": SP},
        "tp+sp compiled": {"parallel": TP, "tp": SP, "compile": COUNTING},
        "tp+sp inductor": {"parallel": TP, "tp": SP, "compile": {"backend": "inductor"}},
        "tp+ac": {"parallel": TP, "checkpoint": AC},
        "tp+ac compiled": {"parallel": TP, "checkpoint": AC, "compile": COUNTING},
    }
    results = run_distributed(compile_tp_workers.train, 2, runs, STEPS, MICRO_BATCH, timeout=540)
    for rank, result in enumerate(results):
        for eager, compiled in (
            ("tp", "tp compiled"),
            ("tp+sp", "tp+sp compiled"),
            ("tp+sp", "tp+sp inductor"),
            ("tp+ac", "tp+ac compiled"),
        ):
            what = f"rank {rank} {compiled}"
            run = result[compiled]
            assert run["tp"] == 2, what
            compile_workers.assert_same_training(run, result[eager], what)
            assert result[eager]["graph_calls"] == 0 and result[eager]["watch"] is None
            # The graph breaks at the tensor-parallel operators, and only there.
            breaks = run["graph_breaks"]
            assert breaks and all(DISABLED in r.splitlines()[0] for r in breaks), (what, breaks)
            # One summary, no recompilation reported after step 2.
            (summary,) = run["watch"]
            assert f"for {BLOCKS} blocks" in summary and "graph breaks" in summary, summary
            assert "(reduce_from_tensor_region)" in summary or "(reduce_scatter_to" in summary, (
                summary
            )
        for compiled in ("tp compiled", "tp+sp compiled", "tp+ac compiled"):
            run = result[compiled]
            # Pieces of every block run compiled, every micro-batch of every step (under
            # activation checkpointing, again when backward recomputes them) ...
            recomputed = 2 if compiled == "tp+ac compiled" else 1
            assert run["graph_calls"] >= recomputed * BLOCKS * MICRO_BATCHES * STEPS, compiled
            # ... and nothing compiles after the first step (no guard on comm counters).
            graphs = run["graphs_after_step"]
            assert graphs[0] > 0 and graphs[-1] == graphs[0], (compiled, graphs)
    assert results[0]["tp+sp compiled"]["losses"] == results[1]["tp+sp compiled"]["losses"]
