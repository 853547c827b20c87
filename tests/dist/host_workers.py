"""Rank functions for the host map and hierarchical collectives on Gloo: ranks given the
environment torchrun gives the workers of `--nnodes N --node-rank i` agents."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from plait.core.comm import Comm, world_group
from plait.core.config import load_config
from plait.core.host_map import learn_host_map
from plait.core.plugins import Plugins
from plait.daemon.telemetry_schema import SPAN_COMM_BYTES_INTER_NODE, SPAN_COMM_BYTES_INTRA_NODE
from plait.plugins.collectives import CollectivesPlugin

BACKEND_ONLY = (("torch_comm", "plait.plugins.torch_comm"),)
SIZES = (1, 6, 7, 1001, 1200)  # 7 and 1001 divide by neither 2 nor 4: padded
REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def torchrun_env(rank: int, world_size: int, nnodes: int, host: str = "") -> dict[str, str]:
    """What torchrun's local agent sets for worker `rank` when `nnodes` agents of
    `world_size / nnodes` workers each rendezvous statically (`--node-rank i`):
    torch/distributed/elastic/agent/server/local_elastic_agent.py, `_start_workers`."""
    per_node = world_size // nnodes
    env = {
        "RANK": str(rank),
        "GROUP_RANK": str(rank // per_node),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "host-map-test",
    }
    if host:
        env["PLAIT_HOST_NAME"] = host
    return env


def as_nodes(rank: int, world_size: int, nnodes: int, host: str = "") -> None:
    os.environ.update(torchrun_env(rank, world_size, nnodes, host))


def host_map_of_world(rank: int, world_size: int, nnodes: int, host: str) -> dict[str, Any]:
    if nnodes:
        as_nodes(rank, world_size, nnodes, host)
    elif host:
        os.environ["PLAIT_HOST_NAME"] = f"{host}{rank % 2}"  # host name only: 2 hosts
    host_map = learn_host_map()
    return {
        "node_of_rank": host_map.node_of_rank,
        "hosts": host_map.hosts,
        "source": host_map.source,
        "line": host_map.describe(),
        "same_0_1": host_map.same_node(0, 1),
        "same_1_2": host_map.same_node(1, 2),
        "nodes_of_world": host_map.nodes_of(range(world_size)),
        "is_uniform": host_map.is_uniform,
    }


def _comm(algorithm: str) -> tuple[Comm, CollectivesPlugin]:
    plugin = CollectivesPlugin()
    plugins = Plugins.create(autoload=False, builtins=BACKEND_ONLY, extra=[("collectives", plugin)])
    table = {} if algorithm == "auto" else {"comm": {"algorithm": algorithm}}
    plugins.configure(load_config(table))
    return Comm(plugins), plugin


def integers(seed: int, numel: int) -> torch.Tensor:
    """Integer-valued floats: sums in any order are exact."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, (numel,), generator=generator).float()


def hierarchical_equals_flat(rank: int, world_size: int, nnodes: int) -> dict[str, Any]:
    """Every op and size through the hierarchical algorithm against Gloo's flat op, bit for
    bit; and which sub-ops it issued (what reached the backend, on which groups)."""
    as_nodes(rank, world_size, nnodes)
    comm, plugin = _comm("auto")
    group = world_group()
    mismatches: list[str] = []
    carried: set[str] = set()
    for numel in SIZES:
        for name, backend_op in REDUCE_OPS.items():
            local = integers(100 * rank + numel, numel)
            expected = local.clone()
            dist.all_reduce(expected, op=backend_op)
            got = local.clone()
            comm.all_reduce(got, group=group, op=name, purpose="grad_bucket").wait()
            if not torch.equal(got, expected):
                mismatches.append(f"all_reduce {name} numel={numel}")
            if name in ("sum", "max"):
                chunk = numel
                source = integers(7 * rank + numel, chunk * world_size)
                want = torch.empty(chunk)
                dist.reduce_scatter_tensor(want, source.clone(), op=backend_op)
                out = torch.empty(chunk)
                comm.reduce_scatter(out, source, group=group, op=name, purpose="grad_shard").wait()
                if not torch.equal(out, want):
                    mismatches.append(f"reduce_scatter {name} chunk={chunk}")
        piece = integers(rank + numel, numel)
        want = torch.empty(numel * world_size)
        dist.all_gather_into_tensor(want, piece)
        out = torch.empty(numel * world_size)
        comm.all_gather(out, piece, group=group, purpose="param_gather").wait()
        if not torch.equal(out, want):
            mismatches.append(f"all_gather numel={numel}")
    # A shaped, non-contiguous-origin tensor keeps its shape.
    shaped = integers(rank, 15).view(3, 5)
    expected = shaped.clone()
    dist.all_reduce(expected)
    comm.all_reduce(shaped, group=group, purpose="grad_bucket").wait()
    if not torch.equal(shaped, expected):
        mismatches.append("all_reduce 3x5")
    probe = torch.ones(5)
    request_marks = []

    class Recorder:
        from plait.core.hookspecs import hookimpl

        @hookimpl(wrapper=True)
        def plait_communicate(self, request: Any) -> Any:
            result = yield
            request_marks.append((request.op, request.purpose, request.group_ranks,
                                  request.attributes.get("carried_by")))  # fmt: skip
            return result

    comm.plugins.register(Recorder(), "recorder")
    comm.all_reduce(probe, group=group, purpose="grad_bucket").wait()
    carried = {f"{op}|{purpose}|{list(ranks)}|{by}" for op, purpose, ranks, by in request_marks}
    plugin.plait_job_end()
    return {
        "algorithm": plugin.algorithm,
        "mismatches": mismatches,
        "hierarchies": sorted(plugin.hierarchies),
        "marks": sorted(carried),
        "probe": probe.tolist(),
    }


__all__ = [
    "SPAN_COMM_BYTES_INTER_NODE",
    "SPAN_COMM_BYTES_INTRA_NODE",
    "as_nodes",
    "hierarchical_equals_flat",
    "host_map_of_world",
    "torchrun_env",
]


def mesh_with_tp(rank: int, world_size: int, nnodes: int, tp: int) -> str:
    """Build the mesh with `tp` on `nnodes` torchrun nodes; the refusal's text, or "ok"."""
    from plait.core.host_map import HostMapError
    from plait.core.mesh import Mesh

    as_nodes(rank, world_size, nnodes, host="hostA")
    try:
        Mesh.from_env(tp=tp, device="cpu")
    except HostMapError as exc:
        return str(exc)
    return "ok"
