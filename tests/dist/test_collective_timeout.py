"""Collective timeouts: the rank that waited names the op, its seq and who never arrived."""

from __future__ import annotations

import re

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import timeout_workers

pytestmark = pytest.mark.dist

TIMEOUT_SECONDS = 3.0
STALL_STEP = 1


def test_timeout_names_op_seq_and_missing_rank() -> None:
    waiting, stalled = run_distributed(
        timeout_workers.stall_one_rank, 2, 1, STALL_STEP, TIMEOUT_SECONDS, timeout=120
    )
    seq = stalled["stalled_seq"]
    assert seq is not None and stalled["error"] is None, stalled
    assert waiting["error"] is not None, "rank 0 did not time out"
    assert (waiting["op"], waiting["group"], waiting["seq"]) == ("all_reduce", "dp", seq)
    assert waiting["missing_ranks"] == (1,)
    message = waiting["error"]
    assert f"all_reduce seq {seq} (purpose grad_bucket) on group 'dp'" in message
    assert "rank(s) 1 did not arrive" in message
    assert f"after {TIMEOUT_SECONDS:g} s (train.collective_timeout_seconds)" in message
    # What the missing rank did last on the group: the collective just before (since DDP re-cuts
    # its buckets after the first step, the broadcast of the new bucket order).
    assert re.search(rf"rank 1 last entered \w+ seq {seq - 1} \(purpose \w+\)", message), message
    assert "1 collective(s) behind" in message
