"""Ring and tree all-reduce over Gloo send/recv equal Gloo's own all-reduce, world sizes 2-4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.core.comm import Comm, world_group
from plait.core.plugins import Plugins
from plait.core.testing import run_distributed
from plait.plugins.collectives import CollectivesPlugin
from plait.plugins.collectives.config import CommConfig, TreeConfig
from plait.plugins.collectives.metering import TrafficMeter

pytestmark = pytest.mark.dist

BACKEND_ONLY = (("torch_comm", "plait.plugins.torch_comm"),)
SIZES = (1, 7, 1001)
BACKEND_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def compare_with_backend(rank: int, world_size: int) -> dict[str, float]:
    configs = {
        "ring": CommConfig(algorithm="ring"),
        # Exercise both exchange patterns of the tree plugin: 1 KiB splits them.
        "tree": CommConfig(algorithm="tree", tree=TreeConfig(small_message_bytes=1024)),
    }
    checksums: dict[str, float] = {}
    for algorithm, config in configs.items():
        plugin, meter = CollectivesPlugin(config), TrafficMeter()
        plugins = Plugins.create(
            autoload=False,
            builtins=BACKEND_ONLY,
            extra=[("traffic_meter", meter), ("collectives", plugin)],
        )
        comm = Comm(plugins)
        plugin.bind(comm)
        group = world_group()
        for numel in SIZES:
            for reduce_op, backend_op in BACKEND_OPS.items():
                generator = torch.Generator().manual_seed(1000 * rank + numel)
                local = torch.randn(numel, generator=generator)
                expected = local.clone()
                dist.all_reduce(expected, op=backend_op)
                result = local.clone()
                work = comm.all_reduce(result, group=group, op=reduce_op, purpose="grad_bucket")
                work.wait()
                torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
                checksums[f"{algorithm}/{numel}/{reduce_op}"] = float(result.double().sum())
        # The steps went through the communicate hook as point-to-point sends of our purpose.
        sent = meter.bytes_for(lambda p, name=algorithm: p == f"{name}/grad_bucket", op="send")
        assert sent > 0, f"{algorithm} sent nothing through the hook"
        assert meter.bytes_for(lambda p: True, op="all_reduce") == sum(
            4 * n * len(BACKEND_OPS) for n in SIZES
        ), "only the requested all-reduces, none issued by the algorithm itself"
    return checksums


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_and_tree_equal_the_backend_all_reduce(world_size: int) -> None:
    checksums = run_distributed(compare_with_backend, world_size, timeout=60)
    # Every rank ends with the same values (replicas must not drift).
    assert all(c == checksums[0] for c in checksums)
