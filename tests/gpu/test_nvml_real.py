"""The NVML collector against the real library and GPU: utilization while a kernel runs,
memory, power and an energy counter that advances."""

from __future__ import annotations

import time

import pytest
import torch

from plait.daemon.nvml import NvmlCollector


def test_nvml_sees_this_gpu_working() -> None:
    pytest.importorskip("pynvml", reason="nvidia-ml-py provides pynvml")
    collector = NvmlCollector(interval=0.1)
    assert collector.available, collector.status
    before = {s.index: s for s in collector.sample()}
    a = torch.randn(8192, 8192, device="cuda")
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        a = (a @ a).tanh_()
    samples = collector.sample()
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    busy = next(s for s in samples if s.index == device)
    assert "NVIDIA" in busy.name or busy.name, busy
    assert busy.utilization is not None and busy.utilization > 0.5, busy
    assert busy.memory_used_bytes and busy.memory_used_bytes > 8192 * 8192 * 4, busy
    assert busy.power_watts and busy.power_watts > 0, busy
    if busy.energy_joules is not None and before[device].energy_joules is not None:
        assert busy.energy_joules > before[device].energy_joules, (before[device], busy)
