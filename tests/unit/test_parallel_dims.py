"""`ParallelDims`: every degree declared once and validated before any plugin runs; the mesh
is built from it and no strategy changes it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.core.engine import Engine
from plait.core.errors import ConfigError, MeshError
from plait.core.host_map import HostMap
from plait.core.mesh import Mesh
from plait.core.parallel_dims import ParallelDims


def test_dp_fills_the_world_and_splits_into_replicas_of_shards() -> None:
    dims = ParallelDims.resolve(16, tp=2, dp_shard=2)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (1, 4, 2, 1, 2)
    assert dims.dp == 8 and dims.world_size == 16 and dims.hybrid_sharded
    assert dims.degrees == {"pp": 1, "dp": 8, "cp": 1, "tp": 2}
    plain = ParallelDims.resolve(4)
    assert (plain.dp_replicate, plain.dp_shard, plain.hybrid_sharded) == (1, 4, False)


def test_dp_shard_node_resolves_from_the_host_map() -> None:
    nodes = HostMap.assumed(4, 4)  # 4 nodes of 4 ranks
    dims = ParallelDims.resolve(16, tp=2, dp_shard="node", host_map=nodes)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_shard_requested) == (4, 2, "node")
    with pytest.raises(MeshError, match="dp_shard = 'node' needs nodes of equal size"):
        ParallelDims.resolve(16, dp_shard="node")


@pytest.mark.parametrize(
    ("world", "asked", "error", "message"),
    [
        (6, {"tp": 4}, MeshError, r"pp=1 × cp=1 × tp=4 = 4 do not divide the world size 6"),
        (8, {"dp": 2, "tp": 2}, MeshError, r"= 4 but the world size is 8"),
        (8, {"dp_shard": 3}, MeshError, r"dp_shard = 3 must divide dp = 8"),
        (6, {"ep": 4}, ConfigError, r"parallel.ep = 4 does not divide the dp degree 6"),
        (8, {"ep": 2, "cp": 2}, MeshError, r"expert parallelism with context parallelism"),
    ],
)
def test_a_layout_that_cannot_work_is_refused_by_name(
    world: int, asked: dict[str, int], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        ParallelDims.resolve(world, **asked)  # type: ignore[arg-type]


def test_the_record_is_immutable() -> None:
    dims = ParallelDims.resolve(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.dp_shard = 1  # type: ignore[misc]


def test_the_mesh_layout_cannot_be_changed_after_it_is_built() -> None:
    mesh = Mesh({"pp": 1, "dp": 2, "cp": 1, "tp": 1}, torch.device("cpu"), None, 0, 2)  # type: ignore[arg-type]
    for name, value in (("dp_shard", 1), ("degrees", {"dp": 1}), ("dims", None)):
        with pytest.raises(MeshError, match=f"mesh.{name} is fixed"):
            setattr(mesh, name, value)


def test_an_engine_under_hsdp_runs_on_the_mesh_its_config_declared() -> None:
    engine = Engine(
        config={
            "telemetry": {"enabled": False},
            "train": {"device": "cpu", "global_batch_size": 1},
            "model": {"name": "llama", "size": "tiny"},
            "parallel": {"dp_strategy": "zero3", "dp_shard": 1},
        }
    )
    try:
        assert engine.mesh.dims == ParallelDims.resolve(1, dp_shard=1)
        assert engine.mesh.data_parallel_split  # the strategy asked for the declared groups
    finally:
        engine.close()
