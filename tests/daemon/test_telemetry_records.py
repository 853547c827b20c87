"""A comm record holds what its request said, field by field, whatever the op's operands."""

from __future__ import annotations

import time

import pytest
import torch

from plait.core.records import CommRequest
from plait.plugins.telemetry.comm_records import CommRecord


def request(op: str, tensors: tuple[torch.Tensor, ...], **fields: object) -> CommRequest:
    settings: dict[str, object] = {"group_name": "tp", "group_ranks": (2, 3), "seq": 7}
    settings.update(fields)
    return CommRequest(op=op, tensors=tensors, group=None, **settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("made", "nbytes"),
    [
        (request("all_reduce", (torch.zeros(6, dtype=torch.bfloat16),), purpose="grad_bucket",
                 async_op=True), 12),
        # Gather and scatter count the rank's own operand, the second tensor.
        (request("all_gather", (torch.zeros(8), torch.zeros(4)), purpose="tp_activation"), 16),
        (request("reduce_scatter", (torch.zeros(2), torch.zeros(4, dtype=torch.float64))), 32),
        (request("send", (torch.zeros(3, 5)[:, :2],), peer=1), 24),  # a view: its own elements
        (request("barrier", ()), 0),
    ],
)  # fmt: skip
def test_a_record_copies_its_request(made: CommRequest, nbytes: int) -> None:
    before = time.time_ns()
    record = CommRecord.begin(made, step=4)
    assert record.nbytes == made.nbytes == nbytes
    assert (record.op, record.group_name, record.group_ranks, record.seq, record.purpose) == (
        made.op, made.group_name, made.group_ranks, made.seq, made.purpose,
    )  # fmt: skip
    assert (record.peer, record.async_op, record.step) == (made.peer, made.async_op, 4)
    assert record.dtype == (made.tensors[0].dtype if made.tensors else None)
    assert before <= record.start_ns <= time.time_ns() and record.end_ns == 0
