"""Packed rows under context parallelism, against one process with no cp: plait's Llama and a
transformers `LlamaForCausalLM` (tiny, from a config) on rows packing documents of lengths 1, 2
and primes, a document spanning its row, boundaries exactly on shard edges and trailing padding
scored nowhere, under cp 2 ring, cp 2 Ulysses, cp 4 hybrid (2 × 2) and cp 2 × dp 2 (whose dp
ranks score different numbers of tokens): the loss within 1e-5 and every gradient within 2e-5 at
each of 2 steps. Under cp 2, changing one document's tokens leaves every other document's
logits unchanged (1e-6). Negative controls: the same runs with attention handed no documents
differ from the reference, and leak one document's change into the others' logits."""

from __future__ import annotations

from typing import Any

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import cp_documents_workers

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

TIMEOUT = 420.0
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 2e-5
PROBE_TOLERANCE = 1e-6
MODELS = ("plait", "hf")


def _case(model: str, *, drop: bool = False, probe: bool = False, **parallel: Any) -> dict:
    return {"model": model, "parallel": parallel, "drop_documents": drop, "probe": probe}


TWO_RANKS = {
    **{f"{m}-ring2": _case(m, cp=2, probe=True) for m in MODELS},
    **{f"{m}-ulysses2": _case(m, cp=2, cp_strategy="ulysses") for m in MODELS},
    **{f"{m}-ring2-no-documents": _case(m, cp=2, drop=True, probe=True) for m in MODELS},
}
FOUR_RANKS = {
    **{f"{m}-hybrid2x2": _case(m, cp=4, cp_strategy="hybrid") for m in MODELS},
    **{f"{m}-cp2-dp2": _case(m, cp=2, dp=2) for m in MODELS},
}


@pytest.fixture(scope="module")
def plait_reference() -> dict[str, Any]:
    return run_distributed(cp_documents_workers.plait_reference, 1, timeout=TIMEOUT)[0]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(cp_documents_workers.run_cases, 2, TWO_RANKS, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_distributed(cp_documents_workers.run_cases, 4, FOUR_RANKS, timeout=TIMEOUT)


def _differences(got: dict[str, Any], reference: dict[str, Any]) -> tuple[float, float]:
    """The largest loss and gradient differences over the steps."""
    losses = zip(got["losses"], reference["losses"], strict=True)
    worst_loss = max(abs(a - b) for a, b in losses)
    worst_grad = 0.0
    assert len(got["grads"]) == len(reference["grads"])
    for held, whole in zip(got["grads"], reference["grads"], strict=True):
        assert held.keys() == whole.keys()
        for name, grad in held.items():
            worst_grad = max(worst_grad, (grad - whole[name]).abs().max().item())
    return worst_loss, worst_grad


def _reference(results: dict[str, Any], case: str, plait_reference: dict[str, Any]) -> dict:
    return results[case]["reference"] if case.startswith("hf") else plait_reference


def _assert_matches(ranks: list[dict[str, Any]], case: str, plait_reference: Any) -> None:
    for rank, results in enumerate(ranks):
        loss, grad = _differences(results[case], _reference(results, case, plait_reference))
        assert loss <= LOSS_TOLERANCE, (case, rank, loss)
        assert grad <= GRAD_TOLERANCE, (case, rank, grad)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [c for c in sorted(TWO_RANKS) if "no-documents" not in c])
def test_two_ranks_match_one_process(case: str, two_ranks: Any, plait_reference: Any) -> None:
    _assert_matches(two_ranks, case, plait_reference)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(FOUR_RANKS))
def test_four_ranks_match_one_process(case: str, four_ranks: Any, plait_reference: Any) -> None:
    _assert_matches(four_ranks, case, plait_reference)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", MODELS)
def test_attention_handed_no_documents_differs(
    model: str, two_ranks: Any, plait_reference: Any
) -> None:
    case = f"{model}-ring2-no-documents"
    for results in two_ranks:
        loss, grad = _differences(results[case], _reference(results, case, plait_reference))
        assert loss > 100 * LOSS_TOLERANCE and grad > 100 * GRAD_TOLERANCE, (case, loss, grad)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", MODELS)
def test_one_documents_tokens_change_no_other_documents_logits(model: str, two_ranks: Any) -> None:
    for rank, results in enumerate(two_ranks):
        probe = results[f"{model}-ring2"]["probe"]
        assert probe["outside"] <= PROBE_TOLERANCE, (model, rank, probe)
        # The control: without documents the change leaks into the documents after it (on
        # both ranks: rank 0 holds the row's end, rank 1 the rest of the changed document's row).
        leaked = results[f"{model}-ring2-no-documents"]["probe"]
        assert leaked["outside"] > 1e-3, (model, rank, leaked)
    # The changed document itself (held by rank 1) does change.
    assert two_ranks[1][f"{model}-ring2"]["probe"]["inside"] > 1e-3


def test_the_ring_skips_blocks_that_share_no_document(two_ranks: Any, four_ranks: Any) -> None:
    """Row 1 spans its row, so no block of a micro-batch holding it is skipped; the hybrid's
    micro-batches are the same. The counter is read back all the same (None: no ring)."""
    for results in two_ranks:
        assert results["plait-ring2"]["skipped_blocks"] is not None
        assert results["plait-ulysses2"]["skipped_blocks"] is None
    for results in four_ranks:
        assert results["plait-hybrid2x2"]["skipped_blocks"] is not None
