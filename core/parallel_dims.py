"""The parallel degrees of one job, declared once (torchtitan's `ParallelDims`).

`ParallelDims.resolve` turns `[parallel]` and the world into one immutable record — pp,
dp_replicate, dp_shard, cp, tp, ep — validated in one place before any plugin runs; the mesh
(`plait.core.mesh`) is built from it and no strategy changes it afterwards. `dp = dp_replicate
× dp_shard`: without `parallel.dp_shard` every dp rank shards (dp_replicate = 1), as plain
ZeRO does; `dp_shard = "node"` resolves here, from the host map, to the dp ranks one node
holds. `ep` is carved out of dp (it is not a mesh axis of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.core.errors import ConfigError, MeshError
from plait.core.host_map import HostMap

# `parallel.dp_shard = "node"`: as many dp ranks as one node holds.
DP_SHARD_NODE = "node"


def resolve_degrees(world_size: int, *, dp: int, tp: int, pp: int, cp: int) -> dict[str, int]:
    """Fill in dp = -1 and check that the degrees multiply to the world size."""
    others = tp * pp * cp
    if dp == -1:
        if world_size % others:
            raise MeshError(
                f"parallel degrees pp={pp} × cp={cp} × tp={tp} = {others} do not divide the "
                f"world size {world_size}; set parallel.* so that pp·dp·cp·tp = {world_size}"
            )
        dp = world_size // others
    degrees = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    product = pp * dp * cp * tp
    if product != world_size:
        raise MeshError(
            f"parallel degrees pp={pp} × dp={dp} × cp={cp} × tp={tp} = {product} but the world "
            f"size is {world_size}; the product must equal the number of ranks"
        )
    return degrees


@dataclass(frozen=True)
class ParallelDims:
    """Every degree of one job; `pp · dp_replicate · dp_shard · cp · tp` = the world size."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1
    # `parallel.dp_shard` as written (None: not asked for; "node" or a degree): a strategy
    # that does not shard must refuse it rather than ignore it.
    dp_shard_requested: int | str | None = None

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def degrees(self) -> dict[str, int]:
        """The device mesh's axes and their sizes, outermost first."""
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    @property
    def hybrid_sharded(self) -> bool:
        """Whether dp is split into replicas of smaller shard groups (HSDP)."""
        return self.dp_shard < self.dp

    @classmethod
    def resolve(
        cls,
        world_size: int,
        *,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        dp_shard: int | str | None = None,
        host_map: HostMap | None = None,
    ) -> ParallelDims:
        """Validate the degrees `[parallel]` asks for on `world_size` ranks (`host_map`
        resolves `dp_shard = "node"`); a `MeshError` or `ConfigError` names what is wrong."""
        degrees = resolve_degrees(world_size, dp=dp, tp=tp, pp=pp, cp=cp)
        shard = _resolve_dp_shard(dp_shard, degrees, host_map)
        if ep > 1 and degrees["dp"] % ep:
            raise ConfigError(f"parallel.ep = {ep} does not divide the dp degree {degrees['dp']}")
        if ep > 1 and cp > 1:
            raise MeshError("expert parallelism with context parallelism is not supported yet")
        return cls(
            pp=pp,
            dp_replicate=degrees["dp"] // shard,
            dp_shard=shard,
            cp=cp,
            tp=tp,
            ep=ep,
            dp_shard_requested=dp_shard,
        )


def _resolve_dp_shard(
    value: int | str | None, degrees: dict[str, int], host_map: HostMap | None
) -> int:
    """`parallel.dp_shard` as a degree: None = dp (shard over every dp rank), "node" = the dp
    ranks one node holds (its ranks over cp × tp), an integer must divide dp."""
    dp, inner = degrees["dp"], degrees["cp"] * degrees["tp"]
    if value is None:
        return dp
    if value == DP_SHARD_NODE:
        per_node = host_map.ranks_per_node if host_map is not None else 0
        if not per_node:
            raise MeshError(
                "parallel.dp_shard = 'node' needs nodes of equal size; the host map is "
                f"{host_map.describe() if host_map else 'unknown'}"
            )
        if per_node % inner:
            raise MeshError(
                f"parallel.dp_shard = 'node': a node's {per_node} ranks are not a whole "
                f"number of cp × tp = {inner} groups"
            )
        value = min(max(per_node // inner, 1), dp)
    if not isinstance(value, int) or value < 1 or dp % value:
        raise MeshError(
            f"parallel.dp_shard = {value!r} must divide dp = {dp} (dp_replicate = "
            f"dp / dp_shard), or be '{DP_SHARD_NODE}'"
        )
    return value
