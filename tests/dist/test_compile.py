"""The compile transform: blocks compiled in place train like eager ones, alone, under DDP /
ZeRO-2 with AMP and activation checkpointing, and as pipeline stages; the blocks really run
compiled code; unknown backends are refused by name (layouts: `test_compile_zero3.py`)."""

from __future__ import annotations

import pytest
import torch

from plait.core.errors import ConfigError
from plait.testing.distributed import run_distributed
from tests.dist import compile_workers

pytestmark = pytest.mark.dist

STEPS = 3
BLOCKS = 2
COUNTING = {"backend": compile_workers.COUNTING_BACKEND}


def _assert_same_training(got: dict, want: dict, tol: float, what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=tol, atol=tol, msg=what
    )
    assert got["names"] == want["names"], f"{what}: parameter names changed"
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=tol, atol=tol, msg=name)


def test_compiled_blocks_train_like_eager_blocks_over_two_ranks() -> None:
    runs = {
        "ddp": {},
        "ddp compiled": {"compile": COUNTING},
        "zero2+amp+ac": {"dp": "zero2", "amp": {"dtype": "bf16", "param_dtype": "fp32"},
                         "checkpoint": {"mode": "full"}},
        "zero2+amp+ac compiled": {"dp": "zero2", "amp": {"dtype": "bf16", "param_dtype": "fp32"},
                                  "checkpoint": {"mode": "full"}, "compile": COUNTING},
        "pp": {"parallel": {"pp": 2}, "schedule": {"name": "1f1b"}},
        "pp compiled": {"parallel": {"pp": 2}, "schedule": {"name": "1f1b"},
                        "compile": COUNTING},
    }  # fmt: skip
    # Two micro-batches per step: gradients accumulate across compiled backward passes.
    results = run_distributed(compile_workers.train, 2, runs, STEPS, 2, timeout=300)
    for rank, result in enumerate(results):
        for eager, compiled in (("ddp", "ddp compiled"), ("zero2+amp+ac", "zero2+amp+ac compiled")):
            # The graph runs the same aten ops as eager, in the same order: equal up to rounding.
            _assert_same_training(result[compiled], result[eager], 1e-5, f"rank {rank} {compiled}")
            assert result[eager]["graph_calls"] == 0
            # Every block's forward goes through its graph: blocks × micro-batches × steps (the
            # checkpointed run's recomputation runs inside the compiled backward).
            assert result[compiled]["graph_calls"] >= BLOCKS * 2 * STEPS, compiled
            # One graph for both blocks (they share code), plus its backward.
            assert 1 <= result[compiled]["graphs"] <= 2, compiled
        # A pipeline stage holds one of the two blocks: one call per micro-batch and step.
        _assert_same_training(result["pp compiled"], result["pp"], 1e-5, f"rank {rank} pp")
        assert result["pp compiled"]["graph_calls"] == 2 * STEPS
    assert results[0]["ddp compiled"]["losses"] == results[1]["ddp compiled"]["losses"]


def test_inductor_trains_like_eager() -> None:
    runs = {"eager": {}, "inductor": {"compile": {"backend": "inductor"}}}
    (result,) = run_distributed(compile_workers.train, 1, runs, STEPS, 4, timeout=300)
    # Generated kernels fuse and reorder float arithmetic: close, not equal.
    _assert_same_training(result["inductor"], result["eager"], 2e-4, "inductor")


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"compile": {"backend": "no_such_backend"}}, "'no_such_backend' is not a torch.compile"),
    ],
)
def test_refused_with_the_field_and_what_is_allowed(run: dict, message: str) -> None:
    compile_workers._register_counting_backend()
    with pytest.raises(ConfigError, match=message):
        compile_workers.make_engine(run, 8, 1)


def test_a_transformers_model_compiles_after_its_flops_are_counted() -> None:
    # A model without a FLOPs formula is counted on the first step under torch's
    # FlopCounterMode, which the compiler cannot trace: that step runs eagerly, the next ones
    # compiled, and the count is the eager one.
    results = run_distributed(compile_workers.train_hf, 2, STEPS, timeout=300)
    for result in results:
        eager, compiled = result["eager"], result["compiled"]
        assert compiled["names"] == eager["names"]
        assert compiled["flops_per_token"] == eager["flops_per_token"] > 0
        torch.testing.assert_close(
            torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-5
        )
        assert compiled["graph_calls"] == BLOCKS * (STEPS - 1), compiled["graph_calls"]
