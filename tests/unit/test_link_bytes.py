"""The host map and the byte formulas of plait.core.link_bytes, with exact integers."""

from __future__ import annotations

import pytest

from plait.core.comm_algorithms import chosen_algorithm
from plait.core.config import load_config
from plait.core.host_map import HostMap, HostMapError, RankPlace, check_inside_nodes, ranges
from plait.core.link_bytes import LinkBytes, flat_bytes, op_link_bytes

TWO_BY_TWO = HostMap.from_places(
    [RankPlace(0, "hostA"), RankPlace(0, "hostA"), RankPlace(1, "hostA"), RankPlace(1, "hostA")]
)
WORLD = (0, 1, 2, 3)


def test_node_rank_wins_over_the_host_name() -> None:
    assert TWO_BY_TWO.node_of_rank == (0, 0, 1, 1) and TWO_BY_TWO.source == "node rank"
    assert TWO_BY_TWO.same_node(0, 1) and not TWO_BY_TWO.same_node(1, 2)
    assert TWO_BY_TWO.nodes_of([3, 2, 0]) == (1, 0)
    assert TWO_BY_TWO.ranks_of_node == ((0, 1), (2, 3)) and TWO_BY_TWO.is_uniform
    assert TWO_BY_TWO.describe() == (
        "2 × 2 ranks (node0: ranks 0-1 on hostA, node1: ranks 2-3 on hostA)"
    )
    by_host = HostMap.from_places([RankPlace(None, h) for h in ("a", "b", "a", "b")])
    assert by_host.node_of_rank == (0, 1, 0, 1) and by_host.source == "host name"
    # One rank without a node rank: the host names decide for all.
    mixed = HostMap.from_places([RankPlace(0, "a"), RankPlace(None, "a"), RankPlace(1, "b")])
    assert mixed.node_of_rank == (0, 0, 1)
    uneven = HostMap.from_places([RankPlace(0, "a"), RankPlace(0, "a"), RankPlace(1, "b")])
    assert not uneven.is_uniform and uneven.describe().startswith("2 nodes, 2+1 ranks")


def test_a_node_rank_on_two_hosts_is_refused() -> None:
    with pytest.raises(HostMapError, match=r"ranks 0 and 1 report node rank 0 on two hosts"):
        HostMap.from_places([RankPlace(0, "a"), RankPlace(0, "b")])


def test_assumed_map_and_ranges() -> None:
    assumed = HostMap.assumed(2, 3)
    assert assumed.node_of_rank == (0, 0, 0, 1, 1, 1)
    assert assumed.describe() == (
        "2 × 3 ranks (node0: ranks 0-2, node1: ranks 3-5), assumed from --nnodes/--nproc-per-node"
    )
    assert ranges([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"


def test_a_group_across_nodes_is_refused_by_name() -> None:
    check_inside_nodes(TWO_BY_TWO, "tp", [(0, 1), (2, 3)])
    with pytest.raises(HostMapError) as caught:
        check_inside_nodes(TWO_BY_TWO, "tp", [(0, 1, 2, 3)])
    text = str(caught.value)
    assert "tp group [0, 1, 2, 3] spans 2 nodes" in text
    assert "ranks 0-1 on node0 (hostA), ranks 2-3 on node1 (hostA)" in text


def test_hierarchy_of_a_group() -> None:
    hierarchy = TWO_BY_TWO.hierarchy(WORLD)
    assert hierarchy is not None
    assert hierarchy.intra == ((0, 1), (2, 3)) and hierarchy.cross == ((0, 2), (1, 3))
    assert hierarchy.chunk_order() == (0, 2, 1, 3)
    assert TWO_BY_TWO.hierarchy((0, 2)) is None  # one rank per node: flat
    assert TWO_BY_TWO.hierarchy((0, 1)) is None  # one node: flat
    # Group order need not follow the nodes: chunks still land on their ranks.
    assert TWO_BY_TWO.hierarchy((3, 0, 2, 1)).chunk_order() == (1, 2, 3, 0)


def test_flat_ring_formulas_on_two_by_two() -> None:
    numel, itemsize = 1200, 4
    B = numel * itemsize
    # all-reduce: 2·(n−1)/n·B to the right neighbour; 1→2 and 3→0 cross nodes.
    sent = [flat_bytes("all_reduce", WORLD, r, numel=numel, itemsize=4, host_map=TWO_BY_TWO)
            for r in WORLD]  # fmt: skip
    assert sent == [LinkBytes(3 * B // 2, 0), LinkBytes(0, 3 * B // 2)] * 2
    for op in ("reduce_scatter", "all_gather"):
        assert flat_bytes(op, WORLD, 1, numel=numel, itemsize=4, host_map=TWO_BY_TWO) == (
            LinkBytes(0, 3 * B // 4)
        )
    # broadcast from rank 2: the chain 2→3→0→1; rank 1 is last, rank 3's hop crosses.
    chain = [flat_bytes("broadcast", WORLD, r, numel=numel, itemsize=4, host_map=TWO_BY_TWO,
                        peer=2) for r in WORLD]  # fmt: skip
    assert chain == [LinkBytes(B, 0), LinkBytes(), LinkBytes(B, 0), LinkBytes(0, B)]
    # all-to-all: a quarter to each other rank; one of them on this node.
    assert flat_bytes("all_to_all", WORLD, 0, numel=numel, itemsize=4, host_map=TWO_BY_TWO) == (
        LinkBytes(B // 4, B // 2)
    )
    uneven = flat_bytes("all_to_all", WORLD, 0, numel=0, itemsize=4, host_map=TWO_BY_TWO,
                        bytes_per_peer=[5, 7, 11, 13])  # fmt: skip
    assert uneven == LinkBytes(7, 24)
    assert flat_bytes("send", WORLD, 1, numel=10, itemsize=2, host_map=TWO_BY_TWO, peer=2) == (
        LinkBytes(0, 20)
    )
    assert flat_bytes("recv", WORLD, 2, numel=10, itemsize=2, host_map=TWO_BY_TWO, peer=1) == (
        LinkBytes()
    )
    # A length that does not divide: whole chunks of ⌈7/4⌉ = 2 elements.
    assert flat_bytes("all_reduce", WORLD, 0, numel=7, itemsize=4, host_map=TWO_BY_TWO) == (
        LinkBytes(2 * 3 * 2 * 4, 0)
    )


def test_hierarchical_formulas() -> None:
    numel = 1200
    B = numel * 4
    for rank in WORLD:
        got = op_link_bytes("all_reduce", WORLD, rank, numel=numel, itemsize=4,
                            host_map=TWO_BY_TWO, algorithm="hierarchical")  # fmt: skip
        assert got == LinkBytes(B, B // 2)  # B/2 + B/2 inside, (B/2)·2·(2−1)/2 across
        for op in ("reduce_scatter", "all_gather"):
            got = op_link_bytes(op, WORLD, rank, numel=numel, itemsize=4, host_map=TWO_BY_TWO,
                                algorithm="hierarchical")  # fmt: skip
            assert got == LinkBytes(B // 2, B // 4)  # (k−1)/k·B inside, (m−1)·B/n across
    # Padded: 7 elements, shard ⌈7/2⌉ = 4; across, 2·(2−1)·⌈4/2⌉ = 4 elements.
    assert op_link_bytes("all_reduce", WORLD, 0, numel=7, itemsize=4, host_map=TWO_BY_TWO,
                         algorithm="hierarchical") == LinkBytes(32, 16)  # fmt: skip
    # 3 nodes × 2: every rank sends 2·(m−1)/(m·k)·B across, 2·(k−1)/k·B inside.
    three = HostMap.assumed(3, 2)
    group = tuple(range(6))
    numel = 1200
    for rank in group:
        got = op_link_bytes("all_reduce", group, rank, numel=numel, itemsize=4, host_map=three,
                            algorithm="hierarchical")  # fmt: skip
        assert got == LinkBytes(numel * 4, 2 * 2 * numel * 4 // 6)
    # No model for an algorithm that names none.
    assert op_link_bytes("all_reduce", WORLD, 0, numel=8, itemsize=4, host_map=TWO_BY_TWO,
                         algorithm="powersgd") is None  # fmt: skip


def test_hierarchical_is_the_default_on_several_nodes_of_several_ranks() -> None:
    unset, named = load_config({}), load_config({"comm": {"algorithm": "torch"}})
    assert chosen_algorithm(unset, TWO_BY_TWO).name == "hierarchical"
    assert chosen_algorithm(load_config(unset), TWO_BY_TWO).name == "hierarchical"  # reloaded
    assert chosen_algorithm(named, TWO_BY_TWO).name == "torch"
    assert chosen_algorithm(unset, HostMap.assumed(2, 1)).name == "torch"
    assert chosen_algorithm(unset, HostMap.assumed(1, 4)).name == "torch"
