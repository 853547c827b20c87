"""`attach_resilience`: what `[resilience]` asks for is added to the engine, and only by it
(a `Checkpointer` alone adds neither the NaN/Inf guard nor the fault injector)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from plait.plugins.checkpoint.checkpointer import Checkpointer
from plait.plugins.checkpoint.config import CheckpointIOConfig
from plait.plugins.resilience import ResilienceConfig, attach_resilience
from plait.plugins.resilience.config import FaultInjectionConfig
from plait.plugins.resilience.fault_injection import FaultInjector
from plait.plugins.resilience.nonfinite_guard import NonFiniteGuard


@pytest.fixture
def engine() -> Iterator[Any]:
    from plait.core.engine import Engine

    engine = Engine(
        config={
            "model": {"name": "llama", "size": "tiny"},
            "data": {"seq_len": 16},
            "train": {"steps": 2, "global_batch_size": 2, "micro_batch_size": 2, "seed": 1,
                      "device": "cpu"},
            "telemetry": {"enabled": False},
        }
    )  # fmt: skip
    yield engine
    engine.close()


def test_a_checkpointer_alone_attaches_nothing(engine: Any) -> None:
    runtimes = list(engine.runtimes)
    Checkpointer(engine, None, CheckpointIOConfig(every=3))
    assert engine.runtimes == runtimes
    assert engine.plugins.manager.get_plugin("fault_injection") is None


def test_the_default_section_attaches_the_guard_last(engine: Any) -> None:
    attached = attach_resilience(engine, ResilienceConfig())
    assert isinstance(attached.guard, NonFiniteGuard)
    assert engine.runtimes[-1] is attached.guard
    assert attached.guard.max_consecutive == 3
    assert attached.fault_injector is None
    assert engine.plugins.manager.get_plugin("fault_injection") is None


def test_fault_injection_registers_a_plugin_and_zero_turns_the_guard_off(engine: Any) -> None:
    runtimes = list(engine.runtimes)
    section = ResilienceConfig(
        max_consecutive_nonfinite=0,
        fault_injection=FaultInjectionConfig(kill_after_step=4, rank=1),
    )
    attached = attach_resilience(engine, section)
    assert attached.guard is None and engine.runtimes == runtimes
    assert isinstance(attached.fault_injector, FaultInjector)
    assert engine.plugins.manager.get_plugin("fault_injection") is attached.fault_injector
    assert attached.fault_injector.config.kill_after_step == 4
