"""Bytes per link class for jobs plait did not launch: the host map comes from what torchrun or
Slurm tells each rank (no collective), and the observed collectives — DDP's buckets, FSDP2's
all-gathers and reduce-scatters — get the backend's byte model on it."""

from __future__ import annotations

import torch

from plait.daemon.telemetry_schema import COMM_ALGORITHM_BACKEND
from plait.plugins.telemetry.comm_links import CommLinks
from plait.plugins.telemetry.observe_comm import CommLedger
from plait.plugins.telemetry.observe_identity import launch_host_map

TORCHRUN_2x2 = {"GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


def test_the_launcher_says_which_ranks_share_a_node() -> None:
    torchrun = launch_host_map(4, TORCHRUN_2x2)
    assert torchrun is not None and torchrun.node_of_rank == (0, 0, 1, 1)
    slurm = launch_host_map(6, {"SLURM_NNODES": "3", "SLURM_NTASKS_PER_NODE": "2"})
    assert slurm is not None and slurm.node_of_rank == (0, 0, 1, 1, 2, 2)
    one = launch_host_map(2, {"GROUP_WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "2"})
    assert one is not None and one.num_nodes == 1
    # Uneven nodes (torchrun elastic with a short node) or no launcher: not guessed.
    assert launch_host_map(4, {"GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"}) is None
    assert launch_host_map(4, {}) is None


def _ledger(rank: int) -> tuple[CommLedger, object]:
    ledger = CommLedger()
    host_map = launch_host_map(4, TORCHRUN_2x2)
    ledger.links = CommLinks(rank, host_map)
    world = object()  # stands for the default group of 4 ranks
    ledger._groups[world] = ("world", (0, 1, 2, 3))
    return ledger, world


def test_a_ddp_bucket_on_two_nodes_counts_the_ring_model() -> None:
    bucket = torch.zeros(1024)  # B = 4096 bytes
    B = bucket.nbytes
    sent = {}
    for rank in range(4):
        ledger, world = _ledger(rank)
        record = ledger.begin("all_reduce", bucket, world, purpose="grad_bucket", overlappable=True)
        assert record.algorithm == COMM_ALGORITHM_BACKEND
        sent[rank] = (record.links.intra_node, record.links.inter_node)
    # A ring all-reduce sends 2·(n−1)/n·B per rank; the ring 0→1→2→3→0 crosses nodes at 1→2
    # and 3→0: those ranks send everything across, the others everything inside.
    assert sent == {0: (3 * B // 2, 0), 1: (0, 3 * B // 2), 2: (3 * B // 2, 0), 3: (0, 3 * B // 2)}


def test_an_fsdp_all_gather_counts_the_whole_output() -> None:
    ledger, world = _ledger(1)
    shard, output = torch.zeros(256), torch.zeros(1024)
    record = ledger.begin(
        "all_gather", shard, world, purpose="param_gather", overlappable=False, whole=output
    )
    assert record.nbytes == shard.nbytes  # what this rank put in
    # (n−1)/n of the whole output leaves each rank; rank 1's ring hop is the crossing one.
    assert (record.links.intra_node, record.links.inter_node) == (0, 3 * output.nbytes // 4)


def test_no_launcher_figures_no_link_bytes() -> None:
    ledger = CommLedger()
    world = object()
    ledger._groups[world] = ("world", (0, 1))
    record = ledger.begin(
        "all_reduce", torch.zeros(8), world, purpose="grad_bucket", overlappable=True
    )
    assert record.links is None and record.algorithm == COMM_ALGORITHM_BACKEND
