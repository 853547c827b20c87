"""Compiled blocks under context parallelism, ring and Ulysses: plait's Llama and a `transformers`
Llama train like eager blocks on two Gloo ranks (cp = 2), the graph breaks only at the
context-parallel attention call (which runs eagerly, the breaks counted in the summary), and
nothing compiles after step 2 — the communicator's counters are never traced. Which layouts compile at
all: tests/unit/test_compile_layouts.py."""

from __future__ import annotations

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import compile_cp_workers, compile_workers
from tests.dist.precision_workers import GLOBAL_BATCH

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

STEPS = 5
BLOCKS = 2
MICRO_BATCHES = 2
MICRO_BATCH = GLOBAL_BATCH // MICRO_BATCHES  # dp = 1: each rank takes the whole batch
COUNTING = {"backend": compile_workers.COUNTING_BACKEND}
INDUCTOR = {"backend": "inductor"}
RING = {"cp": 2, "cp_strategy": "ring"}
ULYSSES = {"cp": 2, "cp_strategy": "ulysses"}
# What Dynamo says when it meets the context-parallel attention call (calling or inlining it).
DISABLED = "`torch.compiler.disable()`d function"
# The graph breaks Dynamo counts compiling the blocks, all at the eager attention call, whose
# name the summary gives, as measured with torch 2.13 (Dynamo counts each time its tracing
# reaches the call, from the block's frame and from frames nested in it). Asserted exactly: an
# exchange traced or made eager on its own (3 for the ring), or a counter Dynamo guards on,
# changes the count.
BREAKS = {"llama": (2, "ContextParallelAttention.__call__"),
          "transformers": (5, "TransformersAttention.__call__")}  # fmt: skip
# eager run -> its compiled twins
PAIRS = {
    "ring": ("ring compiled", "ring inductor"),
    "ulysses": ("ulysses compiled",),
    "transformers ring": ("transformers ring compiled",),
    "transformers ulysses": ("transformers ulysses compiled", "transformers ulysses inductor"),
}


def _runs() -> dict[str, dict]:
    runs = {}
    for eager, compiled in PAIRS.items():
        strategy = RING if "ring" in eager else ULYSSES
        run = {"parallel": strategy, "transformers": eager.startswith("transformers")}
        runs[eager] = run
        for name in compiled:
            runs[name] = {**run, "compile": INDUCTOR if "inductor" in name else COUNTING}
    return runs


@pytest.mark.timeout(600)
def test_compiled_blocks_under_context_parallelism_train_like_eager() -> None:
    results = run_distributed(compile_cp_workers.train, 2, _runs(), STEPS, MICRO_BATCH, timeout=540)
    for rank, result in enumerate(results):
        for eager, twins in PAIRS.items():
            assert result[eager]["graph_calls"] == 0 and result[eager]["watch"] is None
            model = "transformers" if eager.startswith("transformers") else "llama"
            breaks, at = BREAKS[model]
            for compiled in twins:
                what = f"rank {rank} {compiled}"
                run = result[compiled]
                assert run["cp"] == 2, what
                compile_workers.assert_same_training(run, result[eager], what)
                # The graph breaks at the context-parallel attention call, and only there.
                reasons = run["graph_breaks"]
                assert all(DISABLED in r.splitlines()[0] for r in reasons), (what, reasons)
                assert sum(reasons.values()) == breaks, (what, reasons)
                # One summary naming the call, no recompilation reported after step 2.
                (summary,) = run["watch"]
                assert f"for {BLOCKS} blocks, {breaks} graph breaks" in summary, summary
                assert f"({at})" in summary, summary
            run = result[twins[0]]
            # Pieces of every block run compiled from step 2 on (a `transformers` model's first
            # step runs eagerly while plait counts its FLOPs) ...
            micro_batches = MICRO_BATCHES if model == "llama" else 1
            assert run["graph_calls"] >= BLOCKS * micro_batches * (STEPS - 1), twins[0]
            # ... and nothing compiles after step 2 (no guard on comm counters).
            graphs = run["graphs_after_step"]
            assert graphs[1] > 0 and graphs[-1] == graphs[1], (twins[0], graphs)
    assert results[0]["ring inductor"]["losses"] == results[1]["ring inductor"]["losses"]
