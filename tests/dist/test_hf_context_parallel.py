"""Context parallelism for `transformers` models through their own attention interface, against
the user's plain single-process loop: Llama (rotary, grouped-query heads) under ring, Ulysses,
hybrid 2 × 2 and cp composed with dp, ZeRO-2, tp (± sequence parallel) and pp (whose schedule,
named by no one, is 1F1B); GPT-2 (learned positions), Mistral and Qwen2 (q/k/v biases); and
right-padded batches. Every case: 5 steps, fp32, the loss within 1e-5 and every gradient a rank
holds within 2e-5 of the plain loop's at each step (ZeRO: the global gradient norm), every
parameter piece after them too. One spawn per world size trains every case."""

from __future__ import annotations

from typing import Any

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import hf_parallel_workers

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

TIMEOUT = 420.0
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 2e-5


def _case(family: str, *, padded: bool = False, **config: Any) -> dict[str, Any]:
    return {"family": family, "padded": padded, "config": config}


TWO_RANKS = {
    "llama-ring2": _case("llama", parallel={"cp": 2}),
    "llama-ulysses2": _case("llama", parallel={"cp": 2, "cp_strategy": "ulysses"}),
    "gpt2-ring2": _case("gpt2", parallel={"cp": 2}),
    "mistral-ring2": _case("mistral", parallel={"cp": 2}),
    "qwen2-ulysses2": _case("qwen2", parallel={"cp": 2, "cp_strategy": "ulysses"}),
    # Rows of 8 to 16 real tokens, padded on the right with labels -100 there.
    "llama-ring2-right-padded": _case("llama", padded=True, parallel={"cp": 2}),
}
FOUR_RANKS = {
    "llama-hybrid2x2": _case("llama", parallel={"cp": 4, "cp_strategy": "hybrid"}),
    "llama-cp2-dp2": _case("llama", parallel={"cp": 2, "dp": 2}),
    "llama-cp2-dp2-zero2": _case("llama", parallel={"cp": 2, "dp": 2, "dp_strategy": "zero2"}),
    "llama-cp2-tp2": _case("llama", parallel={"cp": 2, "tp": 2}),
    "llama-cp2-tp2-sp": _case("llama", parallel={"cp": 2, "tp": 2}, tp={"sequence_parallel": True}),
    # No schedule named: parallel.pp > 1 picks 1F1B.
    "llama-cp2-pp2": _case("llama", parallel={"cp": 2, "pp": 2}, train={"micro_batch_size": 2}),
}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(hf_parallel_workers.run_cases, 2, TWO_RANKS, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_distributed(hf_parallel_workers.run_cases, 4, FOUR_RANKS, timeout=TIMEOUT)


def assert_matches_plain_loop(ranks: list[dict[str, Any]], case: str) -> None:
    held: set[str] = set()
    for rank, results in enumerate(ranks):
        got = results[case]
        assert got["loss"] <= LOSS_TOLERANCE, (case, rank, got["loss"])
        assert got["grad_norm"] <= GRAD_TOLERANCE, (case, rank, got["grad_norm"])
        assert got["grad"] <= GRAD_TOLERANCE, (case, rank, got["grad"])
        assert got["parameter"] <= GRAD_TOLERANCE, (case, rank, got["parameter"])
        held.update(got["parameters_held"])
    if "zero" not in case:  # ZeRO holds gradients as flat shards: norms only
        assert all(results[case]["compared"] > 0 for results in ranks), case
    assert held == set(ranks[0][case]["parameters_total"]), case


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(TWO_RANKS))
def test_two_ranks_match_the_plain_loop(case: str, two_ranks: Any) -> None:
    assert_matches_plain_loop(two_ranks, case)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(FOUR_RANKS))
def test_four_ranks_match_the_plain_loop(case: str, four_ranks: Any) -> None:
    assert_matches_plain_loop(four_ranks, case)


def test_ring_and_ulysses_traffic_goes_through_the_comm_hook(
    two_ranks: Any, four_ranks: Any
) -> None:
    ring, ulysses = two_ranks[0]["llama-ring2"]["comm"], two_ranks[0]["llama-ulysses2"]["comm"]
    hybrid = four_ranks[0]["llama-hybrid2x2"]["comm"]
    for seen in (ring, hybrid):
        assert seen.get("send/cp_kv", 0) > 0 and seen.get("recv/cp_kv", 0) > 0, seen
    for seen in (ulysses, hybrid):
        assert seen.get("all_to_all/cp_a2a", 0) > 0, seen
    assert not any(key.endswith("/cp_a2a") for key in ring)
    assert not any(key.endswith("/cp_kv") for key in ulysses)


def test_pipeline_without_a_named_schedule_runs_1f1b(four_ranks: Any) -> None:
    for results in four_ranks:
        got = results["llama-cp2-pp2"]
        assert got["schedule"] == "1f1b" and got["schedule_chosen_by_default"], got["schedule"]
        moved = got["comm"].get("send/activation", 0) + got["comm"].get("recv/activation", 0)
        assert moved > 0, got["comm"]
