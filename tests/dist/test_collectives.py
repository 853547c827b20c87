"""Ring and tree over Gloo send/recv equal Gloo's own collectives, world sizes 2-4, and put
exactly the algorithm's bytes on the wire (ring: 2(n-1)/n of the payload per rank)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait.core.comm import Comm, world_group
from plait.core.comm_algorithms import GRAD_BUCKET
from plait.core.config import load_config
from plait.core.plugins import Plugins
from plait.testing.distributed import run_distributed
from plait.plugins.collectives import CollectivesPlugin
from plait.plugins.collectives.metering import TrafficMeter

pytestmark = pytest.mark.dist

BACKEND_ONLY = (("torch_comm", "plait.plugins.torch_comm"),)
SIZES = (1, 7, 1001)
BYTES_NUMEL = 1200  # divisible by 2, 3 and 4: every chunk of every schedule is whole
BACKEND_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
# Exercise both exchange patterns of the tree plugin: 1 KiB splits them.
TABLES: dict[str, dict[str, Any]] = {"ring": {}, "tree": {"small_message_bytes": 1024}}


def make_comm(algorithm: str) -> tuple[Comm, TrafficMeter, CollectivesPlugin]:
    plugin, meter = CollectivesPlugin(), TrafficMeter()
    plugins = Plugins.create(
        autoload=False,
        builtins=BACKEND_ONLY,
        extra=[("traffic_meter", meter), ("collectives", plugin)],
    )
    # The engine's path: configure validates [comm.<name>] and dedicates the dp groups.
    config = load_config({"comm": {"algorithm": algorithm, algorithm: TABLES[algorithm]}})
    plugins.configure(config)
    return Comm(plugins), meter, plugin


def tree_bytes(world_size: int, rank: int, nbytes: int, small_message_bytes: int) -> int:
    """Bytes one rank sends in one halving-doubling all-reduce (see plugins/collectives/tree.py):
    ranks folded away send their vector once; core ranks send 2(p-1)/p of it (halving-doubling)
    or log2(p) times all of it (doubling); odd ranks of the folded pairs send the result back."""
    core = 1 << (world_size.bit_length() - 1)
    extra = world_size - core
    if rank < 2 * extra and rank % 2 == 0:
        return nbytes
    if nbytes < small_message_bytes:
        sent = (core.bit_length() - 1) * nbytes
    else:
        sent = 2 * (core - 1) * nbytes // core
    return sent + (nbytes if rank < 2 * extra else 0)


def compare_with_backend(rank: int, world_size: int) -> dict[str, Any]:
    group = world_group()
    out: dict[str, Any] = {}
    for algorithm in TABLES:
        comm, meter, plugin = make_comm(algorithm)
        assert plugin.runner.has_worker(group.ranks), "the world group has a dedicated mirror"
        for numel in SIZES:
            for reduce_op, backend_op in BACKEND_OPS.items():
                generator = torch.Generator().manual_seed(1000 * rank + numel)
                local = torch.randn(numel, generator=generator)
                expected = local.clone()
                dist.all_reduce(expected, op=backend_op)
                result = local.clone()
                comm.all_reduce(result, group=group, op=reduce_op, purpose=GRAD_BUCKET).wait()
                torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
                out[f"{algorithm}/{numel}/{reduce_op}"] = float(result.double().sum())
        assert meter.bytes_for(lambda p: True, op="all_reduce") == sum(
            4 * n * len(BACKEND_OPS) for n in SIZES
        ), "only the requested all-reduces, none issued by the algorithm itself"

        # Exact wire bytes of one asynchronous all-reduce and one reduce-scatter.
        purpose = f"{algorithm}/{GRAD_BUCKET}"
        meter.reset()
        bucket = torch.full((BYTES_NUMEL,), float(rank + 1))
        comm.all_reduce(bucket, group=group, op="avg", async_op=True, purpose=GRAD_BUCKET).wait()
        assert torch.equal(bucket, torch.full_like(bucket, (world_size + 1) / 2))
        out[f"{algorithm}/all_reduce_bytes"] = meter.bytes_for(
            lambda p, own=purpose: p == own, op="send"
        )

        meter.reset()
        source = torch.arange(BYTES_NUMEL, dtype=torch.float32) * (rank + 1)
        chunk = torch.empty(BYTES_NUMEL // world_size)
        comm.reduce_scatter(chunk, source, group=group, op="sum", purpose=GRAD_BUCKET).wait()
        total = torch.arange(BYTES_NUMEL, dtype=torch.float32) * sum(range(1, world_size + 1))
        assert torch.equal(chunk, total.tensor_split(world_size)[rank]), algorithm
        assert torch.equal(source, torch.arange(BYTES_NUMEL, dtype=torch.float32) * (rank + 1))
        out[f"{algorithm}/reduce_scatter_bytes"] = meter.bytes_for(
            lambda p, own=purpose: p == own, op="send"
        )
        plugin.plait_job_end()
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_and_tree_equal_the_backend_and_send_exact_bytes(world_size: int) -> None:
    results = run_distributed(compare_with_backend, world_size, timeout=120)
    # Every rank ends with the same values (replicas must not drift).
    checksums = [{k: v for k, v in r.items() if "bytes" not in k} for r in results]
    assert all(c == checksums[0] for c in checksums)

    payload = 4 * BYTES_NUMEL
    for rank, result in enumerate(results):
        # Ring: n-1 chunks out in each phase, 2(n-1)/n of the payload; reduce-scatter is one phase.
        assert result["ring/all_reduce_bytes"] == 2 * (world_size - 1) * payload // world_size
        assert result["ring/reduce_scatter_bytes"] == (world_size - 1) * payload // world_size
        # Tree: its own count, and a reduce-scatter is one all-reduce of a copy.
        expected = tree_bytes(world_size, rank, payload, TABLES["tree"]["small_message_bytes"])
        assert result["tree/all_reduce_bytes"] == expected, rank
        assert result["tree/reduce_scatter_bytes"] == expected, rank
