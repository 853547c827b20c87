"""The global gradient norm: exact, shard-weighted, and a few kernels whatever the model size."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from plait.core.grad_norm import clip_grads_, global_grad_norm, mark_sharded
from plait.core.mesh import Mesh


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


class _RecordingComm:
    """Stands in for the world all-reduce: records what this rank contributes."""

    def __init__(self) -> None:
        self.reduced: list[float] = []

    def all_reduce(self, tensor: torch.Tensor, **_: Any) -> None:
        self.reduced.append(float(tensor))


def _mesh(tp: int) -> Mesh:
    degrees = {"pp": 1, "dp": 1, "cp": 1, "tp": tp}
    return Mesh(degrees, torch.device("cpu"), None, rank=0, world_size=tp)  # type: ignore[arg-type]


def _params(count: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for i in range(count):
        p = nn.Parameter(torch.zeros(3 + i % 5, 7))
        p.grad = torch.randn(p.shape, generator=gen)
        params.append(p)
    return params


def test_norm_matches_torch_and_costs_a_few_kernels_not_a_few_per_parameter() -> None:
    params = _params(48)
    expected = torch.nn.utils.get_total_norm([p.grad for p in params])
    with _CountOps() as ops:
        norm = global_grad_norm(params, mesh=_mesh(1), comm=_RecordingComm())  # type: ignore[arg-type]
    torch.testing.assert_close(norm, expected)
    # A per-parameter pass (square, sum, add per gradient) would be > 3 × 48 ops.
    assert ops.count <= 8, f"{ops.count} ops for 48 gradients"


def test_sharded_gradients_count_once_across_the_world(monkeypatch) -> None:
    monkeypatch.setattr("plait.core.grad_norm.world_group", lambda: None)
    params = _params(6)
    for p in params[:3]:
        mark_sharded(p, ("tp",))  # each of the 2 tp ranks holds a distinct shard
    comm = _RecordingComm()
    global_grad_norm(params, mesh=_mesh(2), comm=comm)  # type: ignore[arg-type]
    squares = [float(p.grad.pow(2).sum()) for p in params]
    # Sharded: weight 2/2 (summed over the 2 holders of distinct shards); replicated: 1/2 each.
    expected = sum(squares[:3]) + sum(squares[3:]) / 2
    assert len(comm.reduced) == 1
    assert abs(comm.reduced[0] - expected) < 1e-4 * expected


def test_clipping_scales_to_the_max_norm() -> None:
    params = _params(5)
    norm = global_grad_norm(params, mesh=_mesh(1), comm=_RecordingComm())  # type: ignore[arg-type]
    clip_grads_(params, norm, 0.5)
    clipped = global_grad_norm(params, mesh=_mesh(1), comm=_RecordingComm())  # type: ignore[arg-type]
    assert abs(float(clipped) - 0.5) < 1e-4
