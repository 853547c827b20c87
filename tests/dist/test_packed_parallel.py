"""Packed rows under data, ZeRO-2, tensor and pipeline parallelism equal one process.

plait's Llama under dp2 (DDP), dp2 ZeRO-2, tp2 (± sequence parallel) and pp2 (1F1B, four
micro-batches), and transformers' Llama under dp2, dp2 ZeRO-2 and pp2, each train one step on
the same 4 packed rows: the loss must be the mean over every scored token of the global batch
(1e-5) and every parameter's gradient that of every document run alone (2e-5). Under dp the
two ranks hold 3 and 29 scored tokens, so a mean of rank means fails; under pp a stage that
loses the documents (or the positions) attends across them and fails. One spawn trains all.
"""

from __future__ import annotations

from typing import Any

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import packed_workers

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 2e-5
PIPELINE = {"parallel": {"pp": 2}, "schedule": {"name": "1f1b"}, "train": {"micro_batch_size": 1}}
LAYOUTS: dict[str, dict[str, Any]] = {
    "llama-dp2": {"family": "llama", "parallel": {"dp_strategy": "ddp"}},
    "llama-dp2-zero2": {"family": "llama", "parallel": {"dp_strategy": "zero2"}},
    "llama-tp2": {"family": "llama", "parallel": {"tp": 2}},
    "llama-tp2-sp": {"family": "llama", "parallel": {"tp": 2}, "tp": {"sequence_parallel": True}},
    "llama-pp2": {"family": "llama", **PIPELINE},
    "hf-llama-dp2": {"family": "hf", "parallel": {"dp_strategy": "ddp"}},
    "hf-llama-dp2-zero2": {"family": "hf", "parallel": {"dp_strategy": "zero2"}},
    "hf-llama-pp2": {"family": "hf", **PIPELINE},
}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(packed_workers.run, 2, LAYOUTS, timeout=300)


def test_ranks_hold_uneven_scored_tokens() -> None:
    """What makes dp2 a test of the token-weighted mean: 3 scored tokens on rank 0, 29 on 1."""
    _, targets = packed_workers.plait_batch(packed_workers.documents())
    assert [int((targets[r : r + 2] != -100).sum()) for r in (0, 2)] == [3, 29]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_equals_every_document_alone(layout: str, ranks: list[dict[str, Any]]) -> None:
    reference = "hf_reference" if layout.startswith("hf-") else "plait_reference"
    for rank, results in enumerate(ranks):
        got = results[layout]
        assert got["loss"] == pytest.approx(results[reference], abs=LOSS_TOLERANCE), (layout, rank)
        worst = max(got["grad_differences"].items(), key=lambda item: item[1])
        assert worst[1] <= GRAD_TOLERANCE, (layout, rank, worst)
        assert set(got["grad_differences"]) <= set(got["held"]), (layout, rank)
