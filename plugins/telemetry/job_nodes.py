"""The job's nodes and their daemons, learned once per world: how any daemon finds the others.

At job start every rank says which daemon it exports to; one all-gather over the world (the
same moment the host map was learned, never again during training) gives every rank the list
of nodes, each with its host name, its ranks and its daemon's address. Each node's first rank
then sends the list to its own daemon with its first poll (`ControlClient`), so every daemon of
the job can answer for the whole job (`plait.daemon.job_directory`). Nothing here depends on
the launcher: torchrun (static, c10d, etcd), Slurm and Kubernetes launches all end in a
process group and a host map. An elastic restart is a new world: it gathers and reports again,
and the daemons replace the old list with the new one.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.core.host_map import HostMap, known_host_map, learn_host_map
from plait.proto.plait.v1 import control_pb2

__all__ = ["JobNodes", "gather_job_nodes"]


@dataclass(frozen=True, slots=True)
class JobNodes:
    """Every node of this rank's world, and which of them is this rank's."""

    nodes: tuple[control_pb2.JobNode, ...]
    self_node: int
    reporter: bool  # this rank is its node's first: it tells the node's daemon

    @classmethod
    def from_addresses(cls, host_map: HostMap, addresses: list[str], rank: int) -> JobNodes:
        """The list from each rank's daemon address (`addresses[r]` is rank r's): a node's
        daemon is the one its first rank exports to."""
        nodes = tuple(
            control_pb2.JobNode(
                node=node, host=host_map.hosts[node], daemon=addresses[ranks[0]], ranks=ranks
            )
            for node, ranks in enumerate(host_map.ranks_of_node)
        )
        self_node = host_map.node_of(rank)
        return cls(nodes, self_node, host_map.ranks_of_node[self_node][0] == rank)


def gather_job_nodes(daemon_address: str) -> JobNodes | None:
    """Collective over the world (every rank calls it once, at job start): the job's nodes.
    None without a process group (a one-process job has no other daemon to find)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    host_map = known_host_map() or learn_host_map()
    addresses: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(addresses, daemon_address)
    return JobNodes.from_addresses(host_map, addresses, dist.get_rank())
