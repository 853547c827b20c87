"""Gradient compression on 2 Gloo ranks: loss close to plain all-reduce, bytes cut as expected.

A small MLP is trained for the same seeded steps with the backend's all-reduce and with each
codec; the traffic meter (a wrapper on the communicate hook) counts what each rank contributes.
"""

from __future__ import annotations

import pytest
import torch

from plait.core.comm import Comm, world_group
from plait.core.comm_algorithms import GRAD_BUCKET
from plait.core.config import load_config
from plait.core.plugins import Plugins
from plait.testing.distributed import run_distributed
from plait.plugins.collectives.metering import TrafficMeter
from plait.plugins.collectives.testing import train_data_parallel_mlp
from plait.plugins.compression import CompressionPlugin
from plait.plugins.compression.powersgd import compressed_elements
from plait.plugins.compression.topk import topk_count

pytestmark = pytest.mark.dist

BACKEND_ONLY = (("torch_comm", "plait.plugins.torch_comm"),)
STEPS = 40
POWERSGD_RANK = 2
TOPK_RATIO = 0.05
# name -> (algorithm, its [comm.<algorithm>] table)
CONFIGS: dict[str, tuple[str, dict[str, object]]] = {
    "torch": ("torch", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "powersgd": ("powersgd", {"rank": POWERSGD_RANK}),
    "topk": ("topk", {"ratio": TOPK_RATIO}),
    "topk_no_feedback": ("topk", {"ratio": TOPK_RATIO, "error_feedback": False}),
}


def make_comm(algorithm: str, table: dict[str, object] | None = None) -> tuple[Comm, TrafficMeter]:
    plugin, meter = CompressionPlugin(), TrafficMeter()
    plugins = Plugins.create(
        autoload=False, builtins=BACKEND_ONLY, extra=[("meter", meter), ("compression", plugin)]
    )
    # The engine's path: options from [comm.<name>], dedicated groups for the dp axis.
    plugins.configure(load_config({"comm": {"algorithm": algorithm, algorithm: table or {}}}))
    return Comm(plugins), meter


def train_with_every_codec(rank: int, world_size: int) -> dict[str, object]:
    results: dict[str, object] = {}
    for name, (algorithm, table) in CONFIGS.items():
        comm, meter = make_comm(algorithm, table)
        run = train_data_parallel_mlp(comm, world_group(), rank=rank, steps=STEPS)
        wire = meter.bytes_for(lambda p, a=algorithm: p.startswith(f"{a}/"))
        plain = meter.bytes_for(lambda p: p == GRAD_BUCKET, op="all_reduce")
        results[name] = {
            "losses": run.losses,
            "buckets": run.bucket_numels,
            "checksum": run.parameter_checksum,
            "wire_bytes": wire if algorithm != "torch" else plain,
        }
    results["rank1_exact"] = powersgd_recovers_a_rank_one_gradient(rank)
    results["topk_error"] = topk_cumulative_error(rank)
    results["powersgd_error"] = powersgd_error_after_steps(rank)
    return results


def topk_cumulative_error(rank: int) -> dict[bool, float]:
    """Relative error of the sum of 40 top-k all-reduces of a constant gradient.

    With error feedback what is not sent now is sent later, so the running sum tracks the true
    one; without it the same 5% of entries are sent every step and the rest never.
    """
    errors = {}
    gradient = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    for feedback in (True, False):
        comm, _ = make_comm("topk", {"ratio": 0.05, "error_feedback": feedback})
        total = torch.zeros(1000)
        for _ in range(40):
            bucket = gradient.clone()
            comm.all_reduce(bucket, group=world_group(), op="avg", purpose=GRAD_BUCKET).wait()
            total += bucket
        errors[feedback] = float(torch.linalg.norm(total - 40 * gradient) / (40 * gradient.norm()))
    return errors


def powersgd_error_after_steps(rank: int) -> dict[str, float]:
    """Relative error of a rank-1 PowerSGD all-reduce of a fixed rank-2 matrix after 12 steps.

    With warm start the power iterations accumulate and reach the best rank-1 approximation;
    a fresh random Q each step stays one power iteration away from it.
    """
    generator = torch.Generator().manual_seed(11)
    left, _ = torch.linalg.qr(torch.randn(40, 2, generator=generator))
    right, _ = torch.linalg.qr(torch.randn(40, 2, generator=generator))
    matrix = left @ torch.diag(torch.tensor([1.0, 0.8])) @ right.t()
    errors = {"best": 0.8 / float(torch.linalg.norm(matrix))}
    for warm in (True, False):
        table = {"rank": 1, "warm_start": warm, "error_feedback": False, "seed": 3}
        comm, _ = make_comm("powersgd", table)
        for _ in range(12):
            bucket = matrix.reshape(-1).clone()
            comm.all_reduce(bucket, group=world_group(), op="avg", purpose=GRAD_BUCKET).wait()
        relative = torch.linalg.norm(bucket - matrix.reshape(-1)) / torch.linalg.norm(matrix)
        errors["warm" if warm else "cold"] = float(relative)
    return errors


def powersgd_recovers_a_rank_one_gradient(rank: int) -> float:
    """A bucket whose square view has rank 1 on every rank is all-reduced exactly at r = 1."""
    comm, _ = make_comm("powersgd", {"rank": 1})
    u, v = torch.linspace(-1, 1, 30), torch.linspace(0.5, 2, 30)
    local = torch.outer(u, v).reshape(-1) * (rank + 1)
    expected = torch.outer(u, v).reshape(-1) * 1.5  # the average of (1, 2) × the outer product
    comm.all_reduce(local, group=world_group(), op="avg", purpose=GRAD_BUCKET).wait()
    return float((local - expected).abs().max())


def test_compression_keeps_loss_and_cuts_bytes() -> None:
    per_rank = run_distributed(train_with_every_codec, 2, timeout=90)
    results = per_rank[0]
    for name in CONFIGS:
        # Data-parallel replicas stay identical under every codec.
        assert per_rank[1][name]["checksum"] == results[name]["checksum"], name
    baseline = results["torch"]["losses"]
    assert baseline[-1] < 0.2 * baseline[0], (
        "the task must be learnable for the margins to mean much"
    )
    margins = {"fp16": 0.01, "bf16": 0.01, "powersgd": 0.10, "topk": 0.10}
    for name, margin in margins.items():
        final = results[name]["losses"][-1]
        assert abs(final - baseline[-1]) <= margin * baseline[-1], (name, final, baseline[-1])

    # Bytes each rank puts on the wire per step, against the plain fp32 all-reduce.
    plain = results["torch"]["wire_bytes"]
    buckets = results["torch"]["buckets"]
    assert plain == STEPS * 4 * sum(buckets)
    assert plain / results["fp16"]["wire_bytes"] == 2.0
    assert plain / results["bf16"]["wire_bytes"] == 2.0
    # top-k: k fp32 values and k int32 indices per bucket, about 1 / (2 · ratio).
    topk_bytes = STEPS * sum(8 * topk_count(n, TOPK_RATIO) for n in buckets)
    assert results["topk"]["wire_bytes"] == topk_bytes
    assert plain / topk_bytes == pytest.approx(1 / (2 * TOPK_RATIO), rel=0.05)
    # PowerSGD: P (s × r) and Q (s × r) for the bucket viewed as an s × s matrix, ≈ s / 2r.
    powersgd_bytes = STEPS * sum(4 * compressed_elements(n, POWERSGD_RANK) for n in buckets)
    assert results["powersgd"]["wire_bytes"] == powersgd_bytes
    assert plain / powersgd_bytes > 10

    assert results["rank1_exact"] < 1e-5
    assert results["topk_error"][True] < 0.3 < 0.7 < results["topk_error"][False]
    errors = results["powersgd_error"]
    assert errors["warm"] < errors["best"] * 1.01 < errors["cold"]
