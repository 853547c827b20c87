"""`parallel.pp = 2` and nothing else: plait splits each rank's batch into enough micro-batches
for the default schedule (1F1B needs at least pp) instead of refusing one micro-batch, and the
step's loss is the plain loop's (fp32: four micro-batches of two rows sum in another order)."""

from __future__ import annotations

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import pp_default_workers

pytest.importorskip("transformers")

TOL = 1e-5


@pytest.mark.dist
def test_only_pp_trains_a_transformers_llama_like_the_plain_loop() -> None:
    ranks = run_distributed(pp_default_workers.one_step_with_only_pp, 2, timeout=240)
    for result in ranks:
        assert result["schedule"] == "1f1b"
        # 8 rows, 2 stages: the first count >= 2 x pp that divides 8 is 4, of 2 rows each.
        assert result["micro_batch_size"] == 2
        assert result["loss"] == pytest.approx(result["reference_loss"], abs=TOL, rel=TOL)
        assert result["grad_norm"] == pytest.approx(result["reference_grad_norm"], rel=1e-4)
