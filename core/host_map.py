"""Which ranks share a node: the host map, learned once at start and checked.

The link between nodes is several times slower than the links inside one, so a group that
should stay inside a node (tensor parallelism today) must be checked to, and every collective's
bytes can be split by link class (`plait.core.link_bytes`). Nothing here assumes that
consecutive ranks share a node: each rank says where it runs and the world agrees on it.

Where a rank runs. torchrun gives every worker its agent's node rank, `GROUP_RANK` (from
`--node-rank` with the static rendezvous, in joining order with c10d): two agents on one
machine (`--nnodes 2 --node-rank i` twice) are two nodes, so **the node rank wins over the host
name** when both are known. Without torchrun the host name (`plait.core.host.host_name`) is all
there is, and ranks on one host are one node::

    host_map = learn_host_map()          # collective over the world, once, at mesh creation
    host_map.same_node(0, 3)             # False on 2 nodes x 2 ranks
    host_map.nodes_of([0, 1, 2, 3])      # (0, 1)
    host_map.describe()                  # "2 × 2 ranks (node0: ranks 0-1 on a, node1: ...)"
    check_inside_nodes(host_map, "tp", [(0, 1), (2, 3)])   # raises HostMapError if one spans

`known_host_map()` returns the map learned for the live world without any communication (the
telemetry wrapper and algorithm plugins read it; only `learn_host_map` is collective).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plait.core.errors import MeshError
from plait.core.host import host_name

__all__ = [
    "Hierarchy",
    "HostMap",
    "HostMapError",
    "RankPlace",
    "check_inside_nodes",
    "known_host_map",
    "learn_host_map",
    "ranges",
    "rank_place",
]

SOURCE_NODE_RANK = "node rank"  # torchrun's GROUP_RANK on every rank
SOURCE_HOST_NAME = "host name"  # no node rank: ranks on one host are one node
SOURCE_ASSUMED = "assumed"  # not learned: derived from a launch plan (dry run)


class HostMapError(MeshError):
    """A host map that contradicts itself, or a group meant to stay inside a node that spans
    several."""


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where one rank says it runs: torchrun's node rank (None outside torchrun), its host."""

    node_rank: int | None
    host: str


def rank_place(env: Mapping[str, str] | None = None) -> RankPlace:
    """This process's place, from torchrun's environment and the host name."""
    env = os.environ if env is None else env
    raw = env.get("GROUP_RANK", "").strip()
    return RankPlace(node_rank=int(raw) if raw.lstrip("-").isdigit() else None, host=host_name(env))


@dataclass(frozen=True, slots=True)
class HostMap:
    """The node of every rank of the world.

    Nodes are numbered in the order of their lowest rank; `hosts[n]` is node `n`'s host name.
    `source` says how the map was made (`"node rank"`, `"host name"` or `"assumed"`).
    """

    node_of_rank: tuple[int, ...]
    hosts: tuple[str, ...]
    source: str = SOURCE_HOST_NAME

    def __post_init__(self) -> None:
        used = sorted(set(self.node_of_rank))
        if used != list(range(len(self.hosts))):
            raise HostMapError(
                f"host map: nodes {used} of the ranks do not match the {len(self.hosts)} hosts"
            )

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def from_places(cls, places: Sequence[RankPlace]) -> HostMap:
        """The map of a world whose rank `r` reported `places[r]`.

        The node rank decides when every rank has one; else the host name. Ranks of one node
        rank on two hosts contradict each other (a node rank reused by two agents) and are an
        error naming them.
        """
        if not places:
            raise HostMapError("host map of an empty world")
        by_node_rank = all(p.node_rank is not None for p in places)
        keys: list[Any] = [p.node_rank if by_node_rank else p.host for p in places]
        index: dict[Any, int] = {}
        hosts: list[str] = []
        for rank, (key, place) in enumerate(zip(keys, places, strict=True)):
            if key not in index:
                index[key] = len(hosts)
                hosts.append(place.host)
            elif hosts[index[key]] != place.host:
                first = keys.index(key)
                raise HostMapError(
                    f"ranks {first} and {rank} report node rank {key} on two hosts "
                    f"({hosts[index[key]]!r} and {place.host!r}); each torchrun agent needs its "
                    "own --node-rank"
                )
        source = SOURCE_NODE_RANK if by_node_rank else SOURCE_HOST_NAME
        return cls(tuple(index[k] for k in keys), tuple(hosts), source)

    @classmethod
    def assumed(cls, nnodes: int, nproc_per_node: int, host: str = "") -> HostMap:
        """The map a launch of `nnodes` × `nproc_per_node` gives under torchrun's static
        rendezvous (node `i` holds ranks `i·nproc .. i·nproc + nproc - 1`): for a dry run."""
        if nnodes < 1 or nproc_per_node < 1:
            raise HostMapError(f"cannot lay out {nnodes} nodes of {nproc_per_node} ranks")
        nodes = tuple(r // nproc_per_node for r in range(nnodes * nproc_per_node))
        return cls(nodes, tuple(host for _ in range(nnodes)), SOURCE_ASSUMED)

    # -- questions -------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.node_of_rank)

    @property
    def num_nodes(self) -> int:
        return len(self.hosts)

    @property
    def ranks_of_node(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each node, ascending."""
        out: list[list[int]] = [[] for _ in self.hosts]
        for rank, node in enumerate(self.node_of_rank):
            out[node].append(rank)
        return tuple(tuple(r) for r in out)

    @property
    def is_uniform(self) -> bool:
        """Every node holds the same number of ranks."""
        return len({len(r) for r in self.ranks_of_node}) == 1

    @property
    def ranks_per_node(self) -> int:
        """The ranks of a node when `is_uniform`, else 0."""
        return len(self.ranks_of_node[0]) if self.is_uniform else 0

    def node_of(self, rank: int) -> int:
        return self.node_of_rank[rank]

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of_rank[a] == self.node_of_rank[b]

    def nodes_of(self, group_ranks: Iterable[int]) -> tuple[int, ...]:
        """The distinct nodes `group_ranks` run on, in the order the ranks first reach them."""
        return tuple(dict.fromkeys(self.node_of_rank[r] for r in group_ranks))

    def split(self, group_ranks: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """`group_ranks` cut by node, each part in group order, parts in `nodes_of` order."""
        parts: dict[int, list[int]] = {}
        for rank in group_ranks:
            parts.setdefault(self.node_of_rank[rank], []).append(rank)
        return tuple(tuple(p) for p in parts.values())

    def hierarchy(self, group_ranks: Sequence[int]) -> Hierarchy | None:
        """How a hierarchical collective splits `group_ranks`, or None when it would be the
        flat op: the group on one node, one rank per node, or nodes holding unequal shares."""
        parts = self.split(group_ranks)
        sizes = {len(p) for p in parts}
        if len(parts) < 2 or len(sizes) != 1 or sizes == {1}:
            return None
        intra = tuple(tuple(sorted(p)) for p in parts)
        cross = tuple(tuple(sorted(p[j] for p in intra)) for j in range(len(intra[0])))
        return Hierarchy(tuple(group_ranks), intra, cross)

    # -- words -----------------------------------------------------------------------------------

    def describe(self) -> str:
        """One line: `2 × 2 ranks (node0: ranks 0-1 on hostA, node1: ranks 2-3 on hostB)`."""
        parts = []
        for node, ranks in enumerate(self.ranks_of_node):
            where = f" on {self.hosts[node]}" if self.hosts[node] else ""
            word = "rank" if len(ranks) == 1 else "ranks"
            parts.append(f"node{node}: {word} {ranges(ranks)}{where}")
        if self.is_uniform:
            shape = f"{self.num_nodes} × {self.ranks_per_node} ranks"
        else:
            counts = "+".join(str(len(r)) for r in self.ranks_of_node)
            shape = f"{self.num_nodes} nodes, {counts} ranks"
        line = f"{shape} ({', '.join(parts)})"
        if self.source == SOURCE_ASSUMED:
            line += ", assumed from --nnodes/--nproc-per-node"
        elif self.source == SOURCE_HOST_NAME:
            line += ", by host name"
        return line

    def where(self, ranks: Iterable[int]) -> str:
        """`ranks 0-1 on node0 (hostA), rank 2 on node1 (hostA)`: for error messages."""
        texts = []
        for part in self.split(list(ranks)):
            node = self.node_of_rank[part[0]]
            word = "rank" if len(part) == 1 else "ranks"
            host = f" ({self.hosts[node]})" if self.hosts[node] else ""
            texts.append(f"{word} {ranges(part)} on node{node}{host}")
        return ", ".join(texts)


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """A group cut into `intra` groups (one per node, ranks ascending) and `cross` groups (the
    ranks at local index `j` of every node, ascending): what a hierarchical collective runs
    on. Ascending, because a process group orders its members by global rank."""

    group_ranks: tuple[int, ...]
    intra: tuple[tuple[int, ...], ...]
    cross: tuple[tuple[int, ...], ...]

    @property
    def nodes(self) -> int:
        return len(self.intra)

    @property
    def ranks_per_node(self) -> int:
        return len(self.cross)

    def intra_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.intra if rank in g)

    def cross_of(self, rank: int) -> tuple[int, ...]:
        return next(g for g in self.cross if rank in g)

    def chunk_order(self) -> tuple[int, ...]:
        """Group positions of the chunks in the order a hierarchical reduce-scatter lays them
        out: block (p, t) = the chunk of the rank at position `t` of cross group `p`. A
        reduce-scatter inside the node hands local index `p` the blocks (p, ·); one across
        nodes hands position `t` block (p, t), its own chunk. All-gather runs it backwards."""
        return tuple(self.group_ranks.index(r) for group in self.cross for r in group)


def ranges(ranks: Iterable[int]) -> str:
    """`0-3,6,8-9` for 0 1 2 3 6 8 9 (in the order given; runs of consecutive ranks joined)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def check_inside_nodes(
    host_map: HostMap, name: str, rank_sets: Iterable[Sequence[int]], hint: str = ""
) -> None:
    """Raise `HostMapError` naming the first of `rank_sets` (the groups of `name`, meant to stay
    inside a node) whose ranks run on several nodes, with its ranks and hosts."""
    for ranks in rank_sets:
        nodes = host_map.nodes_of(ranks)
        if len(nodes) > 1:
            raise HostMapError(
                f"{name} group {list(ranks)} spans {len(nodes)} nodes: {host_map.where(ranks)}; "
                f"a {name} group must stay inside one node (host map: {host_map.describe()})"
                + (f". {hint}" if hint else "")
            )


# -- learning it over the world ---------------------------------------------------------------

# The map learned for the live world, keyed by its default process group (held weakly, so a new
# world after destroy_process_group learns its own).
_learned: list[tuple[Any, HostMap]] = []


def _world_key() -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_group()


def known_host_map() -> HostMap | None:
    """The map `learn_host_map` learned for the live world, or None; never communicates."""
    world = _world_key()
    for key, host_map in _learned:
        if world is not None and key() is world:
            return host_map
    return None


def learn_host_map(env: Mapping[str, str] | None = None) -> HostMap:
    """Every rank's place, all-gathered over the world: collective (every rank calls it at the
    same point), once per world; later calls return the map learned. Without a process group,
    a one-rank map of this process."""
    import torch.distributed as dist

    known = known_host_map()
    if known is not None:
        return known
    place = rank_place(env)
    world = _world_key()
    if world is None:
        return HostMap.from_places([place])
    places: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(places, place)
    host_map = HostMap.from_places(places)
    _learned[:] = [(weakref.ref(world), host_map)]
    return host_map
