"""The host map on 4 Gloo ranks given torchrun's environment for 2 nodes x 2, and hierarchical
collectives against Gloo's flat ops, bit for bit on integer-valued floats."""

from __future__ import annotations

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import host_workers

pytestmark = pytest.mark.dist

TIMEOUT = 120.0


def test_host_map_from_node_rank_wins_over_one_host_name() -> None:
    # Two torchrun agents on one machine: one host name, two node ranks, two nodes.
    results = run_distributed(host_workers.host_map_of_world, 4, 2, "hostA", timeout=TIMEOUT)
    for r in results:
        assert r["node_of_rank"] == (0, 0, 1, 1)
        assert r["hosts"] == ("hostA", "hostA")
        assert r["source"] == "node rank"
        assert (r["same_0_1"], r["same_1_2"]) == (True, False)
        assert r["nodes_of_world"] == (0, 1)
        assert r["is_uniform"]
        assert r["line"] == "2 × 2 ranks (node0: ranks 0-1 on hostA, node1: ranks 2-3 on hostA)"


def test_host_map_from_host_names_without_torchrun() -> None:
    # No GROUP_RANK: the host name decides (ranks 0, 2 on hostX0; 1, 3 on hostX1).
    results = run_distributed(host_workers.host_map_of_world, 4, 0, "hostX", timeout=TIMEOUT)
    for r in results:
        assert r["node_of_rank"] == (0, 1, 0, 1)
        assert r["hosts"] == ("hostX0", "hostX1")
        assert r["source"] == "host name"


def test_hierarchical_collectives_equal_flat_ops_bit_for_bit() -> None:
    results = run_distributed(host_workers.hierarchical_equals_flat, 4, 2, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["algorithm"] == "hierarchical", "chosen by default on 2 nodes x 2"
        assert r["mismatches"] == []
        assert r["hierarchies"] == [(0, 1, 2, 3)]
        assert r["probe"] == [4.0] * 5
        node = [0, 1] if rank < 2 else [2, 3]
        cross = [0, 2] if rank % 2 == 0 else [1, 3]
        # The op is marked as the algorithm's; its three steps reached the backend on the
        # node's group, the cross-node group and the node's group again.
        assert r["marks"] == sorted(
            [
                "all_reduce|grad_bucket|[0, 1, 2, 3]|hierarchical",
                f"reduce_scatter|hierarchical/grad_bucket|{node}|torch",
                f"all_reduce|hierarchical/grad_bucket|{cross}|torch",
                f"all_gather|hierarchical/grad_bucket|{node}|torch",
            ]
        )


def test_one_rank_per_node_is_the_flat_op() -> None:
    results = run_distributed(host_workers.hierarchical_equals_flat, 2, 2, timeout=TIMEOUT)
    for r in results:
        assert r["algorithm"] == "torch"  # 2 nodes x 1: nothing to split
        assert r["mismatches"] == []
        assert r["hierarchies"] == []
        assert r["marks"] == ["all_reduce|grad_bucket|[0, 1]|torch"]


def test_a_tp_group_across_nodes_is_refused_by_name() -> None:
    inside = run_distributed(host_workers.mesh_with_tp, 4, 2, 2, timeout=TIMEOUT)
    assert inside == ["ok"] * 4
    refused = run_distributed(host_workers.mesh_with_tp, 4, 2, 4, timeout=TIMEOUT)
    for text in refused:  # every rank refuses alike
        assert "tp group [0, 1, 2, 3] spans 2 nodes" in text
        assert "ranks 0-1 on node0 (hostA), ranks 2-3 on node1 (hostA)" in text
        assert "set parallel.tp to at most 2" in text
