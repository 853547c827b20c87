"""A stand-in for `torch.cuda`'s events on CPU, with the semantics the timing code relies on.

Like a CUDA stream, the fake device runs queued work in order and later than the host queued
it: `launch(ms)` queues kernels and returns at once, `run(ms)` lets the device progress. An
event's `record()` marks the current end of the stream; `query()` is True once the device has
passed the mark (never blocks); `elapsed_time(end)` is the device time between two completed
events in milliseconds and raises, as torch does, while either has not completed.
"""

from __future__ import annotations

from typing import Any


class FakeDevice:
    def __init__(self) -> None:
        self.queued_ms = 0.0  # where the end of the stream is, in device time
        self.done_ms = 0.0  # how far the device has run
        self.events_recorded = 0

    def launch(self, ms: float) -> None:
        self.queued_ms += ms

    def run(self, ms: float | None = None) -> None:
        """Advance the device by `ms` (everything queued when None)."""
        target = self.queued_ms if ms is None else self.done_ms + ms
        self.done_ms = min(target, self.queued_ms)


class FakeEvent:
    def __init__(self, device: FakeDevice, enable_timing: bool = False) -> None:
        assert enable_timing, "timing events must be created with enable_timing=True"
        self.device = device
        self.at_ms: float | None = None

    def record(self, stream: Any = None) -> None:
        self.at_ms = self.device.queued_ms
        self.device.events_recorded += 1

    def query(self) -> bool:
        return self.at_ms is not None and self.device.done_ms >= self.at_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready")
        assert self.at_ms is not None and end.at_ms is not None
        return end.at_ms - self.at_ms


class FakeCuda:
    """The `torch.cuda` namespace as far as `PhaseTimer` and `DeviceAnchor` use it."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # torch.cuda.Event's name
        return FakeEvent(self.device, enable_timing=enable_timing)
