"""Cross-node bytes per step of ZeRO-3 flat, hierarchical and HSDP on 2 nodes x 2: the closed
forms of plait.core.link_bytes equal the per-op ring formulas summed over the ranks, with the
issue's figures (4.5·B, 3·B and 2·B per micro-batch; HSDP independent of the count)."""

from __future__ import annotations

import pytest

from plait.core.config import load_config
from plait.core.host_map import HostMap, RankPlace
from plait.plugins.collectives.step_bytes import sharded_step_bytes, sharded_step_inter_node

TWO_BY_TWO = HostMap.from_places([RankPlace(node, "hostA") for node in (0, 0, 1, 1)])
UNITS = (4096, 1024, 8192)  # numels of the units, each divisible by 4: whole chunks
B = sum(UNITS) * 4  # model bytes (fp32)


def job_inter(layout: str, microbatches: int) -> int:
    """Cross-node bytes of one step summed over the four ranks, op by op."""
    total = 0
    for rank in range(4):
        hsdp = layout == "hsdp"
        node = rank - rank % 2
        shard = (node, node + 1) if hsdp else (0, 1, 2, 3)
        replicas = (rank % 2, rank % 2 + 2) if hsdp else (rank,)
        sent = sharded_step_bytes(
            rank, shard_group=shard, replica_group=replicas, host_map=TWO_BY_TWO,
            gathers=UNITS * 2, reductions=UNITS, itemsize=4, microbatches=microbatches,
            algorithm="hierarchical" if layout == "hierarchical" else "torch",
        )  # fmt: skip
        total += sent.inter_node
    return total


@pytest.mark.parametrize(
    ("layout", "per_microbatch", "fixed"),
    [("flat", 4.5, 0.0), ("hierarchical", 3.0, 0.0), ("hsdp", 0.0, 2.0)],
)
@pytest.mark.parametrize("microbatches", [1, 4])
def test_zero3_cross_node_bytes_per_step(
    layout: str, per_microbatch: float, fixed: float, microbatches: int
) -> None:
    expected = (per_microbatch * microbatches + fixed) * B
    assert job_inter(layout, microbatches) == expected
    closed = sharded_step_inter_node(
        B, nodes=2, ranks_per_node=2, microbatches=microbatches, layout=layout
    )
    assert closed == expected


def test_hsdp_keeps_the_shard_traffic_inside_the_node() -> None:
    for rank in range(4):
        node = rank - rank % 2
        sent = sharded_step_bytes(
            rank, shard_group=(node, node + 1), replica_group=(rank,), host_map=TWO_BY_TWO,
            gathers=UNITS * 2, reductions=UNITS, itemsize=4, microbatches=4,
        )  # fmt: skip
        # 4 micro-batches x 3 ops x (2−1)/2·B, all to the node's other rank.
        assert (sent.intra_node, sent.inter_node) == (6 * B, 0)


def test_dp_shard_is_a_positive_degree_or_node() -> None:
    assert load_config(None, ["parallel.dp_shard=node"]).parallel.dp_shard == "node"
    assert load_config(None, ["parallel.dp_shard=2"]).parallel.dp_shard == 2
    assert load_config(None, []).parallel.dp_shard is None
    for bad in ("0", "rack"):
        with pytest.raises(Exception, match="dp_shard"):
            load_config(None, [f"parallel.dp_shard={bad}"])
