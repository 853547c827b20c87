"""The colocated parameter server on 3 Gloo ranks: sync equals all-reduce, async is exactly
`s` steps stale and still converges; pushes and pulls go through the communicate hook."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.core.comm import Comm, world_group
from plait.core.comm_algorithms import GRAD_BUCKET
from plait.core.config import load_config
from plait.core.plugins import Plugins
from plait.testing.distributed import run_distributed
from plait.plugins.collectives.metering import TrafficMeter
from plait.plugins.collectives.testing import train_data_parallel_mlp
from plait.plugins.param_server import NAME, ParamServerPlugin

pytestmark = pytest.mark.dist

BACKEND_ONLY = (("torch_comm", "plait.plugins.torch_comm"),)
STALENESS = 2
STEPS = 40


def make_comm(table: dict[str, object] | None) -> tuple[Comm, TrafficMeter, ParamServerPlugin]:
    """`table` is `[comm.param_server]`; None selects no algorithm (the backend's all-reduce)."""
    plugin, meter = ParamServerPlugin(), TrafficMeter()
    plugins = Plugins.create(
        autoload=False, builtins=BACKEND_ONLY, extra=[("meter", meter), ("param_server", plugin)]
    )
    comm = {"algorithm": "torch"} if table is None else {"algorithm": NAME, NAME: table}
    plugins.configure(load_config({"comm": comm}))
    return Comm(plugins), meter, plugin


def exercise_parameter_server(rank: int, world_size: int) -> dict[str, object]:
    group = world_group()
    out: dict[str, object] = {}

    # Synchronous mode equals the backend's all-reduce, with every rank or only two serving.
    for num_servers in (0, 2):
        comm, meter, _ = make_comm({"mode": "sync", "num_servers": num_servers})
        for numel in (1, 7, 1001):
            local = torch.randn(numel, generator=torch.Generator().manual_seed(rank * 97 + numel))
            expected = local.clone()
            dist.all_reduce(expected)
            expected /= world_size
            comm.all_reduce(local, group=group, op="avg", purpose=GRAD_BUCKET).wait()
            torch.testing.assert_close(local, expected, rtol=1e-6, atol=1e-6)
        out[f"sync_push_bytes/{num_servers}"] = meter.bytes_for(lambda p: p.endswith("/push"))
        out[f"sync_pull_bytes/{num_servers}"] = meter.bytes_for(lambda p: p.endswith("/pull"))

    # Async mode: the pull at step t is the average of the pushes of step t - s, exactly.
    comm, _, plugin = make_comm({"mode": "async", "staleness": STALENESS})
    pulled = []
    for step in range(8):
        bucket = torch.full((10,), float(10 * step + rank))
        comm.all_reduce(
            bucket, group=group, op="avg", purpose=GRAD_BUCKET, attributes={"bucket_index": 0}
        ).wait()
        pulled.append(bucket.tolist())
    plugin.flush()
    out["async_pulls"] = pulled

    # Training: sync and bounded-staleness async against the plain all-reduce.
    for name, settings in (
        ("torch", None),
        ("sync", {"mode": "sync"}),
        ("async", {"mode": "async", "staleness": STALENESS}),
    ):
        comm, _, plugin = make_comm(settings)
        run = train_data_parallel_mlp(comm, group, rank=rank, steps=STEPS, lr=0.05)
        plugin.flush()
        out[name] = run.losses
    return out


def test_parameter_server_sync_async_and_convergence() -> None:
    world_size = 3
    per_rank = run_distributed(exercise_parameter_server, world_size, timeout=90)
    results = per_rank[0]

    # Colocated, every rank serving: each rank pushes and pulls 2/3 of each bucket.
    floats = 1 + 7 + 1001
    assert results["sync_push_bytes/0"] == 4 * (floats - sum(len(s) for s in (
        torch.arange(n).tensor_split(3)[0] for n in (1, 7, 1001)
    )))  # fmt: skip
    # With two servers, rank 0 pulls only the shard of rank 1 and sends its own to both others.
    assert results["sync_pull_bytes/2"] > results["sync_push_bytes/2"]

    # Staleness: zeros until step s, then exactly the average of step t - s: 10 (t - s) + 1.
    for step, pulled in enumerate(results["async_pulls"]):
        expected = 0.0 if step < STALENESS else 10.0 * (step - STALENESS) + 1.0
        assert pulled == [expected] * 10, (step, pulled)

    baseline, sync, stale = results["torch"], results["sync"], results["async"]
    assert sync[-1] == pytest.approx(baseline[-1], rel=1e-4)
    # Bounded staleness converges, within 15% of the synchronous loss after 40 steps.
    assert stale[-1] < 0.2 * stale[0]
    assert abs(stale[-1] - baseline[-1]) <= 0.15 * baseline[-1], (stale[-1], baseline[-1])
    for other in per_rank[1:]:
        assert other["async"] == stale  # replicas apply the same aggregates
