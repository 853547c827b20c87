"""`plait train`'s banner under ZeRO-3 on 2 ranks: the model's count, and each rank's half."""

from __future__ import annotations

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import banner_workers

pytestmark = pytest.mark.dist


def test_zero3_banner_names_the_models_count_and_the_ranks_share() -> None:
    first, second = run_distributed(banner_workers.zero3_parameter_figures, 2, timeout=180)
    total = first["module_count"]
    # Each rank holds a part; together exactly the model (padding is not a parameter).
    assert 0 < first["held"] < total and 0 < second["held"] < total
    assert first["held"] + second["held"] == total
    for figures in (first, second):
        assert figures["text"] == f"{total:,} parameters, {figures['held']:,} on this rank"
