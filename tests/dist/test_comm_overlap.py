"""Comm algorithms inside a real engine on 2 Gloo ranks: they keep DDP's overlap of gradient
reduction with backward, and they carry ZeRO-2/3's reduce-scatter path (forced on Gloo with
`[zero] gradient_reduction = "reduce_scatter"`, the path GPUs always take)."""

from __future__ import annotations

from typing import Any

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import comm_overlap_workers as workers

pytestmark = pytest.mark.dist

WORLD_SIZE = 2
# fp32 on CPU, same data: two ranks against one process.
LOSS_TOL = 1e-6
# The lossless algorithms against the backend's own reduce-scatter (summation order differs).
EXACT_TOL = 1e-5


@pytest.fixture(scope="module")
def single_process() -> list[float]:
    (losses,) = run_distributed(workers.single_process, 1, timeout=120)
    return losses


@pytest.mark.parametrize("case", sorted(workers.ALGORITHMS))
def test_algorithms_overlap_bucket_reduction_with_backward(
    overlap: list[dict[str, Any]], case: str
) -> None:
    for rank, results in enumerate(overlap):
        run = results[case]
        assert run["buckets"] >= 3, "the model must give DDP several buckets"
        assert run["first_issued_in_backward"], f"rank {rank}: DDP issued bucket 0 after backward"
        assert not run["on_training_thread"], (
            f"rank {rank}: {case} ran its first sub-op inside the hook (completed synchronously)"
        )
        assert run["started_in_backward"], (
            f"rank {rank}: {case} did not start reducing bucket 0 while backward waited for it"
        )
        assert not run["held_timed_out"], (
            f"rank {rank}: backward waited for {case}'s bucket 0 to finish"
        )
        assert workers.finite(run["losses"])
        assert run["sub_ops"] > 0


@pytest.fixture(scope="module")
def overlap() -> list[dict[str, Any]]:
    return run_distributed(workers.overlap_cases, WORLD_SIZE, timeout=300)


@pytest.fixture(scope="module")
def reduce_scatter() -> list[dict[str, Any]]:
    return run_distributed(workers.reduce_scatter_cases, WORLD_SIZE, timeout=400)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_forced_reduce_scatter_path_matches_one_process(
    reduce_scatter: list[dict[str, Any]], single_process: list[float], strategy: str
) -> None:
    run = reduce_scatter[0][f"{strategy}/torch"]
    assert run["ops"].get(("reduce_scatter", "grad_bucket"), 0) > 0
    assert ("all_reduce", "grad_bucket") not in run["ops"]
    assert run["losses"] == pytest.approx(single_process, abs=LOSS_TOL)


@pytest.mark.parametrize("case", sorted(workers.ALGORITHMS))
def test_every_algorithm_carries_the_reduce_scatter_path(
    reduce_scatter: list[dict[str, Any]], case: str
) -> None:
    keys = [f"zero2/{case}"] + ([f"zero3/{case}"] if case in ("ring", "tree") else [])
    for key in keys:
        for results in reduce_scatter:
            run = results[key]
            assert run["ops"].get(("reduce_scatter", "grad_bucket"), 0) > 0, key
            assert run["sub_ops"] > 0, f"{key}: the algorithm took no reduce-scatter over"
            assert workers.finite(run["losses"]), key
        losses = reduce_scatter[0][key]["losses"]
        assert reduce_scatter[1][key]["losses"] == losses, "replicas agree"
        baseline = reduce_scatter[0][f"{key.split('/')[0]}/torch"]["losses"]
        if case in ("ring", "tree", "param_server"):
            assert losses == pytest.approx(baseline, abs=EXACT_TOL), key
        else:
            # Lossy codecs (and one step of staleness) still train: same start, loss going down.
            assert losses[0] == pytest.approx(baseline[0], abs=EXACT_TOL), key
            assert losses[-1] < losses[0], key
