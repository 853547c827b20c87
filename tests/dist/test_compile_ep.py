"""Compiled blocks under expert parallelism: plait's MoE and a `transformers` Mixtral at ep = 2
train like eager blocks on two Gloo ranks. The token exchange (the counts' all-gather, both
all-to-alls and the local experts between them) runs eagerly, a counted graph break at each MoE
layer's experts, so the step's token counts — new every step — are never guarded on: nothing
recompiles after the first compiled step. Which layouts compile at all:
tests/unit/test_compile_layouts.py."""

from __future__ import annotations

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import compile_ep_workers, compile_workers
from tests.dist.precision_workers import GLOBAL_BATCH

pytestmark = pytest.mark.dist

STEPS = 4
BLOCKS = 2
MICRO_BATCHES = 2
MICRO_BATCH = GLOBAL_BATCH // 2 // MICRO_BATCHES  # dp = 2: each rank takes half the batch
COUNTING = {"backend": compile_workers.COUNTING_BACKEND}
# What Dynamo says when it meets the exchange: it skips the `torch.compiler.disable`d call.
DISPATCH = "Skip inlining `torch.compiler.disable()`d function"
# The MoE layers' own routing (boolean-mask selection, `bincount`): breaks with or without ep.
ROUTING = ("Dynamic shape operator", "Data dependent operator")


@pytest.mark.timeout(600)
def test_compiled_blocks_under_expert_parallelism_train_like_eager() -> None:
    runs = {
        "moe": {"family": "moe"},
        "moe compiled": {"family": "moe", "compile": COUNTING},
        "mixtral": {"family": "mixtral"},
        "mixtral compiled": {"family": "mixtral", "compile": COUNTING},
    }
    results = run_distributed(compile_ep_workers.train, 2, runs, STEPS, MICRO_BATCH, timeout=540)
    for rank, result in enumerate(results):
        for eager, compiled, eager_call, first_compiled_step in (
            ("moe", "moe compiled", "ExpertDispatch.__call__", 0),
            # A transformers model's first step runs under the FLOP counter, which Dynamo leaves
            # eager; its experts run through transformers' ExpertsInterface, plait's entry eager.
            ("mixtral", "mixtral compiled", "PlaitExperts.__call__", 1),
        ):
            what = f"rank {rank} {compiled}"
            run = result[compiled]
            assert run["ep"] == 2, what
            compile_workers.assert_same_training(run, result[eager], what)
            assert result[eager]["graph_calls"] == 0 and result[eager]["watch"] is None
            # The graph breaks at the exchange, and otherwise only at the routing's own
            # data-dependent operators.
            firsts = [reason.splitlines()[0] for reason in run["graph_breaks"]]
            assert any(DISPATCH in first for first in firsts), (what, firsts)
            assert all(DISPATCH in f or f.startswith(ROUTING) for f in firsts), (what, firsts)
            # One summary naming the exchange, and no recompilation after the first step:
            # the token counts that change every step are not in any graph.
            (summary,) = run["watch"]
            assert f"for {BLOCKS} blocks" in summary and f"({eager_call})" in summary, summary
            graphs = run["graphs_after_step"][first_compiled_step:]
            assert graphs[0] > 0 and graphs[-1] == graphs[0], (what, graphs)
            assert run["recompile_reasons"] == [], what
            # Pieces of every block run compiled, every step.
            assert run["graph_calls"] >= BLOCKS * (STEPS - first_compiled_step), what
