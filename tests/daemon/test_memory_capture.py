"""The rank's memory answers on their own: a model-state count that fails is the operator's
error, never the training loop's, and the end of a run lets an answer under way through."""

from __future__ import annotations

import json
import threading

import torch

from plait.core.memory import memory_report
from plait.plugins.telemetry.memory_capture import MemoryCapture, MemoryOrder, MemoryResult


def one_metered_step(capture: MemoryCapture, model: torch.nn.Module) -> None:
    capture.arm(MemoryOrder("memory-1", step_wait_seconds=60.0, max_bytes=2**20))
    capture.step_started(3)
    model(torch.randn(4, 8)).sum().backward()
    capture.step_finished(3)


def test_a_count_that_fails_is_answered_as_an_error_and_training_goes_on() -> None:
    delivered: list[MemoryResult] = []
    arrived = threading.Event()

    def deliver(result: MemoryResult) -> None:
        delivered.append(result)
        arrived.set()

    def broken() -> dict[str, int]:
        raise RuntimeError("no storage behind this tensor")

    capture = MemoryCapture(device="cpu", deliver=deliver, accounting=broken)
    one_metered_step(capture, torch.nn.Linear(8, 8))  # raises nothing
    assert arrived.wait(60), "nothing was delivered"
    (result,) = delivered
    assert result.files == {}
    assert result.error == "building the report failed: no storage behind this tensor"


def test_the_end_of_a_run_waits_for_an_answer_under_way() -> None:
    gate, delivered = threading.Event(), []

    def deliver(result: MemoryResult) -> None:
        gate.wait(60)  # a daemon slow to take the answer
        delivered.append(result)

    model = torch.nn.Linear(8, 8)
    capture = MemoryCapture(device="cpu", deliver=deliver, accounting=lambda: memory_report(model))
    one_metered_step(capture, model)
    ending = threading.Thread(target=capture.wait, args=(60.0,))
    ending.start()
    ending.join(0.2)
    assert ending.is_alive() and delivered == []  # still waiting for the delivery
    gate.set()
    ending.join(60)
    assert not ending.is_alive()
    (result,) = delivered
    report = json.loads(result.files["memory.json"])
    assert report["step"] == 3 and report["model_state"] == {
        "parameters": (8 * 8 + 8) * 4,
        "gradients": (8 * 8 + 8) * 4,
        "total": 2 * (8 * 8 + 8) * 4,
    }
