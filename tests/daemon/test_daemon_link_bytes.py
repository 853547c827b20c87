"""The daemon's door and advice for the comm spans' link bytes (plait.comm.bytes.*)."""

from __future__ import annotations

import pytest

from plait.daemon import telemetry_schema as schema
from plait.daemon.bottleneck import RankBreakdown, RankContext, advice
from plait.daemon.decoder import Rejected, decode_span

COMM = {
    schema.SPAN_COMM_OP: "all_reduce",
    schema.SPAN_COMM_PURPOSE: "grad_bucket",
    schema.SPAN_COMM_GROUP: "dp",
    schema.SPAN_COMM_GROUP_RANKS: [0, 1, 2, 3],
    schema.SPAN_COMM_BYTES: 4800,
    schema.SPAN_STEP: 0,
}


def test_link_bytes_are_decoded_and_only_backend_ops_count() -> None:
    span = decode_span("all_reduce", 0, 10, {
        **COMM, schema.SPAN_COMM_ALGORITHM: "torch",
        schema.SPAN_COMM_BYTES_INTRA_NODE: 0, schema.SPAN_COMM_BYTES_INTER_NODE: 7200,
    })  # fmt: skip
    assert span.comm is not None and span.comm.on_the_wire
    assert (span.comm.bytes_intra_node, span.comm.bytes_inter_node) == (0, 7200)
    parent = decode_span("all_reduce", 0, 10, {**COMM, schema.SPAN_COMM_ALGORITHM: "hierarchical",
                         schema.SPAN_COMM_BYTES_INTER_NODE: 2400})  # fmt: skip
    assert parent.comm is not None and not parent.comm.on_the_wire
    older = decode_span("all_reduce", 0, 10, COMM)  # a producer that sends none
    assert older.comm is not None and older.comm.bytes_inter_node == 0


@pytest.mark.parametrize(
    ("attribute", "value", "reason"),
    [
        (schema.SPAN_COMM_BYTES_INTER_NODE, -1, "out of range"),
        (schema.SPAN_COMM_BYTES_INTRA_NODE, "many", "wrong type"),
        (schema.SPAN_COMM_BYTES_INTER_NODE, 1.5, "wrong type"),
        (schema.SPAN_COMM_ALGORITHM, 3, "wrong type"),
    ],
)
def test_bad_link_bytes_are_rejected_by_name(attribute: str, value: object, reason: str) -> None:
    with pytest.raises(Rejected) as caught:
        decode_span("all_reduce", 0, 10, {**COMM, attribute: value})
    assert caught.value.key == f"{attribute}: {reason}"


def _exposed_comm() -> RankBreakdown:
    seconds = dict.fromkeys(
        ("compute", "exposed_comm", "data", "pipeline_bubble", "optimizer", "host_other"), 0.0
    )
    seconds.update(compute=0.02, exposed_comm=0.08)
    return RankBreakdown(
        steps=5, step_seconds=0.1, seconds=seconds, comm_seconds=0.09,
        exposed_comm_by_purpose={"grad_bucket": 0.08}, median_step_seconds=0.1,
        median_compute_seconds=0.02, microbatches=1,
    )  # fmt: skip


def test_bottleneck_names_cross_node_traffic_when_most_bytes_cross() -> None:
    crossing = RankContext(comm_link_bytes=(3 * 2**20, 9 * 2**20), device="cuda:0")
    text = advice(_exposed_comm(), crossing)
    assert "cross-node traffic: 75% of the bytes cross nodes (9.00 MiB of 12.00 MiB" in text
    assert 'comm.algorithm = "hierarchical"' in text
    inside = RankContext(comm_link_bytes=(9 * 2**20, 3 * 2**20), device="cuda:0")
    assert "cross-node" not in advice(_exposed_comm(), inside)
