"""The device mesh: named axes `pp, dp, cp, tp` over the ranks torchrun started.

One explicit object, passed around, never a global (torchtitan's `ParallelDims`). TP is the
innermost axis, so a TP group is made of consecutive ranks and stays inside a node; CP sits
between DP and TP (as in torchtitan: its ring/all-to-all traffic is heavier than DP's and
lighter than TP's); DP and PP span nodes. Vocabulary: an *axis* is a mesh axis, a *dim* is a
tensor dimension.

The mesh also carries the host map (`plait.core.host_map`): which node each rank runs on,
learned from torchrun's node rank and the host name. TP's placement is an assumption about
rank numbering, so it is checked against the map at start: a group of an axis in
`NODE_LOCAL_AXES` (or one a later strategy declares with `require_inside_nodes`) that spans two
nodes is an error naming its ranks and hosts.

Gradients of replicated parameters are reduced over DP and CP together: the CP ranks of one
replica hold the same parameters and see different tokens of the same sequences, so they are
data parallel as far as gradients go (Megatron's "dp × cp" gradient group).

Sharded data parallelism may split DP in two (`parallel.dp_shard`, HSDP): `dp = dp_replicate ×
dp_shard`, ranks ordered `pp, dp_replicate, dp_shard, cp, tp` (torchtitan's `ParallelDims`), so a
shard group is `dp_shard × cp × tp` consecutive ranks and can stay inside a node while the
replica groups cross nodes. The degrees are declared once (`plait.core.parallel_dims`), before
any plugin runs, and the mesh is built from them: no strategy changes it. The device mesh keeps
its `dp` axis (every strategy that does not shard reads it as before); `data_parallel_groups`
gives the two named sub-axes' groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait.core import process_groups
from plait.core.comm import Group
from plait.core.errors import MeshError
from plait.core.host_map import HostMap, check_inside_nodes, learn_host_map
from plait.core.parallel_dims import DP_SHARD_NODE, ParallelDims

MESH_AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
# The two sub-axes `dp` splits into under sharded data parallelism (outer, inner).
DP_REPLICATE, DP_SHARD = "dp_replicate", "dp_shard"
# The axes over which replicated parameters' gradients are averaged (and ZeRO shards).
GRADIENT_AXES: tuple[str, ...] = ("dp", "cp")
# Axes whose groups must stay inside one node (their collectives run every layer).
NODE_LOCAL_AXES: tuple[str, ...] = ("tp",)


def resolve_device(choice: str = "auto") -> torch.device:
    """cuda:LOCAL_RANK when asked for (or available under "auto"), else cpu."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise MeshError("train.device = 'cuda' but no CUDA device is available")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, *, timeout_seconds: float = 600.0) -> None:
    """Join the process group torchrun set up (or a one-rank group when run directly).

    A group created here is plait's to destroy, at interpreter exit (`process_groups`); one
    the caller initialised is left as it is."""
    if dist.is_initialized():
        return
    _create_process_group(device, timeout_seconds)
    process_groups.adopt()


def _create_process_group(device: torch.device, timeout_seconds: float) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_seconds)
    device_id = device if backend == "nccl" else None
    if "TORCHELASTIC_RESTART_COUNT" in os.environ and "MASTER_ADDR" in os.environ:
        # Under torchrun the ranks share the agent's store across restarts. The process group
        # keys its rendezvous entries by group name only, so a restarted rank could read the
        # address a dead rank of the previous attempt published and fail to connect: give every
        # attempt its own key space.
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"plait/attempt-{attempt}", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
        )
    elif "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:
        # A single process outside torchrun: a one-rank group over an in-memory store, so the
        # same code path (collectives included) runs everywhere.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )


@dataclass
class Mesh:
    """Degrees, this rank's coordinates and a process group per axis."""

    degrees: dict[str, int]
    device: torch.device
    device_mesh: DeviceMesh
    rank: int
    world_size: int
    host_map: HostMap | None = None
    # The dp ranks that shard (HSDP's inner sub-axis); None: dp is not split (every dp rank
    # shards, as plain ZeRO does).
    dp_shard: int | None = None
    # The degrees the mesh was built from (None for a mesh assembled by hand in a test).
    dims: ParallelDims | None = None
    _groups: dict[tuple[str, ...], Group] = field(default_factory=dict)
    _split_groups: dict[tuple[str, int], tuple[Group, Group]] = field(default_factory=dict)
    _data_parallel_groups: tuple[Group, Group] | None = None

    # The layout, fixed when the mesh is built from the declared degrees: strategies read it.
    _FIXED: ClassVar[frozenset[str]] = frozenset({"degrees", "dp_shard", "dims", "world_size"})

    def __setattr__(self, name: str, value: object) -> None:
        if name in self._FIXED and name in self.__dict__:
            raise MeshError(
                f"mesh.{name} is fixed when the mesh is built from the declared parallel "
                "degrees (plait.core.parallel_dims.ParallelDims); a strategy reads it and "
                "asks for groups, it never changes the layout"
            )
        super().__setattr__(name, value)

    @classmethod
    def from_env(
        cls,
        *,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        device: str = "auto",
        timeout_seconds: float = 600.0,
        dp_shard: int | str | None = None,
    ) -> Mesh:
        """Join the job's process group and build its mesh from the degrees `[parallel]`
        declares (`ParallelDims.resolve`, which validates them all before anything is built)."""
        torch_device = resolve_device(device)
        init_distributed(torch_device, timeout_seconds=timeout_seconds)
        world_size = dist.get_world_size()
        host_map = learn_host_map()  # collective: before any group is built
        dims = ParallelDims.resolve(
            world_size, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dp_shard=dp_shard, host_map=host_map
        )
        device_mesh = init_device_mesh(
            torch_device.type,
            tuple(dims.degrees[a] for a in MESH_AXES),
            mesh_dim_names=MESH_AXES,
        )
        mesh = cls(
            degrees=dims.degrees,
            device=torch_device,
            device_mesh=device_mesh,
            rank=dist.get_rank(),
            world_size=world_size,
            host_map=host_map,
            dp_shard=dims.dp_shard,
            dims=dims,
        )
        process_groups.track_mesh(mesh)
        for axis in NODE_LOCAL_AXES:
            mesh.require_inside_nodes(axis, mesh.axis_rank_sets(axis))
        if dims.hybrid_sharded:
            # Refused before any plugin runs: a shard group that spans nodes.
            shard_sets, _ = mesh._hybrid_rank_sets(dims.dp_shard)
            mesh.require_inside_nodes(DP_SHARD, [tuple(s) for s in shard_sets])
        return mesh

    def axis_rank_sets(self, axis: str) -> list[tuple[int, ...]]:
        """Every group of mesh axis `axis` (not only this rank's), as global ranks."""
        position = MESH_AXES.index(axis)
        rows = self.device_mesh.mesh.movedim(position, -1).reshape(-1, self.size(axis))
        return [tuple(int(r) for r in row) for row in rows.tolist()]

    def require_inside_nodes(self, name: str, rank_sets: list[tuple[int, ...]]) -> None:
        """Refuse groups meant to stay inside a node (a strategy's own, named `name`) that span
        several: a `HostMapError` naming the group's ranks and hosts. Every rank raises alike
        (the map is the world's)."""
        if self.host_map is None:
            return
        per_node = self.host_map.ranks_per_node
        hint = (
            f"set parallel.{name} to at most {per_node} (the ranks of one node)"
            if name in self.degrees and per_node
            else ""
        )
        if name == DP_SHARD and per_node:
            inner = self.degrees["cp"] * self.degrees["tp"]
            hint = (
                f"set parallel.dp_shard to at most {max(per_node // inner, 1)} or to "
                f"'{DP_SHARD_NODE}' (one node's {per_node} ranks hold dp_shard × cp × tp)"
            )
        check_inside_nodes(self.host_map, name, rank_sets, hint)

    def release(self) -> None:
        """Drop this mesh's process groups (its device mesh holds them) so that destroying
        them frees them; the mesh issues nothing afterwards. Called at interpreter exit."""
        self._groups.clear()
        self._split_groups.clear()
        self._data_parallel_groups = None
        # A DeviceMesh keeps its (and its flattened meshes') groups in its root's registry,
        # inside reference cycles: emptied here, the groups need no garbage collection.
        registry = getattr(self.device_mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
        self.device_mesh = None  # type: ignore[assignment]

    def size(self, axis: str) -> int:
        """The degree of a mesh axis, or of `dp_shard` / `dp_replicate` (dp and 1 when dp is
        not split)."""
        if axis == DP_SHARD:
            return self.dp_shard or self.degrees["dp"]
        if axis == DP_REPLICATE:
            return self.degrees["dp"] // self.size(DP_SHARD)
        return self.degrees[axis]

    def coordinate(self, axis: str) -> int:
        """This rank's index along `axis` (a mesh axis, or a dp sub-axis)."""
        if axis in (DP_SHARD, DP_REPLICATE):
            replica, shard = divmod(self.device_mesh.get_local_rank("dp"), self.size(DP_SHARD))
            return shard if axis == DP_SHARD else replica
        return self.device_mesh.get_local_rank(axis)

    def coordinates(self) -> dict[str, int]:
        """Coordinates on every mesh axis, and on dp's sub-axes once dp is split."""
        axes = MESH_AXES + ((DP_REPLICATE, DP_SHARD) if self.is_hybrid_sharded else ())
        return {axis: self.coordinate(axis) for axis in axes}

    def group(self, *axes: str) -> Group:
        """The group of ranks that differ from this one only along `axes`.

        Several axes give one flattened group. Creating a flattened group is collective: every
        rank must ask for the same axes in the same order.
        """
        key = tuple(a for a in MESH_AXES if a in axes)
        if len(key) != len(axes):
            raise MeshError(f"unknown or repeated mesh axes {axes}; axes are {MESH_AXES}")
        if key not in self._groups:
            self._groups[key] = self._make_group(key)
        return self._groups[key]

    def _make_group(self, axes: tuple[str, ...]) -> Group:
        name = "_".join(axes)
        if len(axes) == 1:
            pg = self.device_mesh.get_group(axes[0])
        else:
            pg = self.device_mesh[axes]._flatten(name).get_group()
        ranks = tuple(dist.get_process_group_ranks(pg))
        return Group(name=name, ranks=ranks, process_group=pg)

    def gradient_axes(self) -> tuple[str, ...]:
        """The axes data parallelism reduces (and ZeRO shards) gradients over: dp, and cp when
        context parallelism is on. A size-1 cp is left out so the group stays the dp group."""
        return tuple(a for a in GRADIENT_AXES if a == "dp" or self.degrees[a] > 1)

    def gradient_group(self) -> Group:
        """The dp × cp group of `gradient_axes` (created on first use: collective)."""
        return self.group(*self.gradient_axes())

    # -- sharded data parallelism: dp = dp_replicate × dp_shard ------------------------------------

    @property
    def is_hybrid_sharded(self) -> bool:
        """Whether dp is split into replicas of smaller shard groups (HSDP)."""
        return self.dp_shard is not None and self.dp_shard < self.degrees["dp"]

    @property
    def data_parallel_split(self) -> bool:
        """Whether a strategy has asked for the shard and replica groups (data_parallel_groups)."""
        return self._data_parallel_groups is not None

    def data_parallel_groups(self) -> tuple[Group, Group]:
        """This rank's (shard group, replica group) for the declared `dp_replicate × dp_shard`:
        the shard group is dp_shard × cp (what ZeRO shards over and reduces gradients in every
        micro-batch), the replica group the dp_replicate ranks that hold the same shard (this
        rank alone when dp is not split). Collective on first call, like `group`."""
        if self._data_parallel_groups is not None:
            return self._data_parallel_groups
        if not self.is_hybrid_sharded:
            self._data_parallel_groups = (self.gradient_group(), self._subgroup(DP_REPLICATE, []))
            return self._data_parallel_groups
        shard_sets, replica_sets = self._hybrid_rank_sets(self.size(DP_SHARD))
        shard_name = "_".join((DP_SHARD, *self.gradient_axes()[1:]))
        self._data_parallel_groups = (
            self._subgroup(shard_name, shard_sets),
            self._subgroup(DP_REPLICATE, replica_sets),
        )
        return self._data_parallel_groups

    def _hybrid_rank_sets(self, dp_shard: int) -> tuple[list[list[int]], list[list[int]]]:
        """Every shard group (dp_shard × cp, in that order) and replica group, as global ranks."""
        pp, dp, cp, tp = (self.degrees[a] for a in MESH_AXES)
        grid = self.device_mesh.mesh.reshape(pp, dp // dp_shard, dp_shard, cp, tp)
        shard_sets = grid.permute(0, 1, 4, 2, 3).reshape(-1, dp_shard * cp).tolist()
        replica_sets = grid.permute(0, 2, 3, 4, 1).reshape(-1, dp // dp_shard).tolist()
        return shard_sets, replica_sets

    def shard_axes(self) -> tuple[str, ...]:
        """The axes a sharded strategy's state is split over: dp_shard (× cp) once dp is
        split, else the gradient axes."""
        if not self.is_hybrid_sharded:
            return self.gradient_axes()
        return (DP_SHARD, *self.gradient_axes()[1:])

    def replica_axes(self) -> tuple[str, ...]:
        """The axes along which shard groups hold identical copies: dp_replicate, or none."""
        return (DP_REPLICATE,) if self.is_hybrid_sharded else ()

    def split_group(self, axis: str, inner: int) -> tuple[Group, Group]:
        """Split `axis` into `inner` consecutive coordinates × `size / inner` strided ones.

        Returns this rank's (inner, outer) groups: the inner group holds the ranks whose
        coordinates on `axis` share `coordinate // inner`, the outer group those that share
        `coordinate % inner` (a 2-D context-parallel group: Ulysses inside, ring across).
        Collective: every rank creates every group, in the same order.
        """
        size = self.size(axis)
        if inner < 1 or size % inner:
            raise MeshError(f"cannot split mesh axis {axis} of size {size} into groups of {inner}")
        if (axis, inner) not in self._split_groups:
            position = MESH_AXES.index(axis)
            rows = self.device_mesh.mesh.movedim(position, -1).reshape(-1, size).tolist()
            inner_sets = [row[i : i + inner] for row in rows for i in range(0, size, inner)]
            outer_sets = [row[k::inner] for row in rows for k in range(inner)]
            pair = tuple(
                self._subgroup(f"{axis}_{kind}", sets)
                for kind, sets in (("inner", inner_sets), ("outer", outer_sets))
            )
            self._split_groups[(axis, inner)] = pair  # type: ignore[assignment]
        return self._split_groups[(axis, inner)]

    def _subgroup(self, name: str, rank_sets: list[list[int]]) -> Group:
        """This rank's group among `rank_sets`; a group of one rank gets no process group."""
        mine, process_group = (self.rank,), None
        for ranks in rank_sets:
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                mine, process_group = tuple(ranks), pg
        return Group(name=name, ranks=mine, process_group=process_group)

    def expert_groups(self, ep: int) -> tuple[Group, Group]:
        """(ep group, expert-data-parallel group) for expert parallelism of degree `ep` carved
        out of dp (Megatron-Core's layout): `ep` consecutive dp coordinates form an ep group,
        the dp / ep ranks that hold the same experts (strided) the expert-dp group.
        Collective on first use, like `split_group`; `ParallelDims` has checked the degree."""
        return self.split_group("dp", ep)

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage `stage` with this rank's other coordinates."""
        return self.group("pp").ranks[stage]
