"""Compiled blocks under tensor parallelism, with and without sequence parallelism: they train
like eager blocks on two Gloo ranks (tp = 2), the graph breaks only at the tensor-parallel
operators (which run eagerly, the breaks counted in the summary), and nothing recompiles after
the first step — the communicator's counters are never traced. With activation checkpointing or
`fullgraph`, tensor parallelism is refused compiled, saying why."""

from __future__ import annotations

import pytest
import torch

from plait.core.config import PlaitConfig
from plait.core.errors import ConfigError
from plait.plugins import compile
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
# What Dynamo says when it meets a tensor-parallel operator (calling or inlining it).
DISABLED = "`torch.compiler.disable()`d function"


def _assert_same_training(got: dict, want: dict, what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-4, atol=1e-4, msg=what
    )
    assert got["params"].keys() == want["params"].keys(), what
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.timeout(600)
def test_compiled_blocks_under_tensor_parallelism_train_like_eager() -> None:
    runs = {
        "tp": {"parallel": TP},
        "tp compiled": {"parallel": TP, "compile": COUNTING},
        "tp+sp": {"parallel": TP, "tp": SP},
        "tp+sp compiled": {"parallel": TP, "tp": SP, "compile": COUNTING},
        "tp+sp inductor": {"parallel": TP, "tp": SP, "compile": {"backend": "inductor"}},
    }
    results = run_distributed(compile_tp_workers.train, 2, runs, STEPS, MICRO_BATCH, timeout=540)
    for rank, result in enumerate(results):
        for eager, compiled in (
            ("tp", "tp compiled"),
            ("tp+sp", "tp+sp compiled"),
            ("tp+sp", "tp+sp inductor"),
        ):
            what = f"rank {rank} {compiled}"
            run = result[compiled]
            assert run["tp"] == 2, what
            _assert_same_training(run, result[eager], what)
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
        for compiled in ("tp compiled", "tp+sp compiled"):
            run = result[compiled]
            # Pieces of every block run compiled, every micro-batch of every step ...
            assert run["graph_calls"] >= BLOCKS * MICRO_BATCHES * STEPS, compiled
            # ... and nothing compiles after the first step (no guard on comm counters).
            graphs = run["graphs_after_step"]
            assert graphs[0] > 0 and graphs[-1] == graphs[0], (compiled, graphs)
    assert results[0]["tp+sp compiled"]["losses"] == results[1]["tp+sp compiled"]["losses"]


def _config(transforms: dict[str, str], **sections: dict) -> PlaitConfig:
    parallel = {"tp": 2, "transforms": {"compile": compile.NAME, **transforms}}
    return PlaitConfig.model_validate({"parallel": parallel, **sections})


def test_tensor_parallelism_alone_is_allowed_compiled() -> None:
    compile._refuse_untested_layouts(_config({}))


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (_config({"ac": "checkpoint"}), "activation checkpointing .*nothing would compile"),
        (_config({}, compile={"fullgraph": True}), "compile.fullgraph = true .*an error"),
    ],
)
def test_tensor_parallelism_is_refused_compiled_where_nothing_or_an_error_would_come_of_it(
    config: PlaitConfig, why: str
) -> None:
    with pytest.raises(ConfigError, match=rf"parallel\.tp = 2 with {why}"):
        compile._refuse_untested_layouts(config)
