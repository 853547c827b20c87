"""AdamW through the kernel facade, the warmup + cosine schedule, and the executor's dispatch."""

from __future__ import annotations

import math

import pytest
import torch

from plait.core.config import OptimizerSection, TrainSection
from plait.core.executor import Executor
from plait.core.kernels import Kernels
from plait.core.optim import AdamW, default_optimizer_factory, param_groups, warmup_cosine
from plait.core.schedule import Forward, SendActivation


def test_warmup_then_cosine_to_the_floor() -> None:
    factor = warmup_cosine(
        OptimizerSection(warmup_steps=4, min_lr_ratio=0.1), TrainSection(steps=24)
    )
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4) == pytest.approx(1.0)
    assert factor(14) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factor(24) == pytest.approx(0.1)
    assert factor(100) == pytest.approx(0.1)
    values = [factor(s) for s in range(4, 25)]
    assert values == sorted(values, reverse=True)


def test_adamw_matches_torch_with_decay_groups(plugins) -> None:
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    build = default_optimizer_factory(OptimizerSection(lr=1e-2, weight_decay=0.1), Kernels(plugins))
    optimizer = build(ours)
    assert isinstance(optimizer, AdamW)
    reference = torch.optim.AdamW(param_groups(theirs, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    for step in range(5):
        for a, b in zip(ours, theirs, strict=True):
            grad = torch.randn_like(a, generator=torch.Generator().manual_seed(step))
            a.grad, b.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_executor_runs_handlers_in_order_and_names_missing_ones() -> None:
    seen: list[int] = []
    executor = Executor({Forward: lambda a: seen.append(a.microbatch)})
    spans = executor.run([Forward(microbatch=0), Forward(microbatch=1)])
    assert seen == [0, 1]
    assert [s.name for s in spans] == ["forward", "forward"]
    assert all(s.end_ns >= s.start_ns for s in spans)
    with pytest.raises(TypeError, match="pipeline strategy"):
        executor.run([SendActivation(microbatch=0, peer_stage=1)])


def test_trace_plugins_env_traces_hook_calls(monkeypatch, capsys) -> None:
    from plait.core.plugins import Plugins

    monkeypatch.setenv("PLAIT_TRACE_PLUGINS", "1")
    from plait.core.schedule import ScheduleRequest

    plugins = Plugins.create(autoload=False)
    plugins.schedule(ScheduleRequest(name="accumulate", num_microbatches=2))
    assert "plait_schedule" in capsys.readouterr().err
