"""Tensor parallel composed with ZeRO: the same losses as with DDP, with gradient accumulation.

ZeRO-2/3 take `.grad` away after every micro-batch, so the tp sum of replicated parameters'
partial gradients (KV heads replicated over tp, norms under sequence parallel) must happen on
every micro-batch there, not only on the last one as with DDP.
"""

from __future__ import annotations

import pytest
import torch

from plait.testing.distributed import run_distributed
from tests.dist import tp_zero_workers

pytestmark = pytest.mark.dist


@pytest.mark.timeout(300)
def test_tp2_with_each_dp_strategy_matches_ddp() -> None:
    ranks = run_distributed(
        tp_zero_workers.train_each_dp_strategy, 4, ["ddp", "zero1", "zero2", "zero3"], timeout=280
    )
    for result in ranks:
        reference = result["ddp"]["losses"]
        assert len(set(reference)) == len(reference), "every step sees a new batch"
        for strategy in ("zero1", "zero2", "zero3"):
            torch.testing.assert_close(
                torch.tensor(result[strategy]["losses"]), torch.tensor(reference),
                rtol=1e-5, atol=1e-5, msg=lambda m, s=strategy: f"{s}: {m}",
            )  # fmt: skip
    # The replicated KV projection stays identical on the two tp ranks of a replica.
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        by_tp = {r[strategy]["tp"]: r[strategy]["wk"] for r in ranks[:2]}
        torch.testing.assert_close(by_tp[0], by_tp[1], rtol=0, atol=1e-7)
