"""Device timing of a step's phases: CUDA events around each action, read after the step.

On a GPU the host returns from `forward` as soon as its kernels are queued, so a host clock
around an action measures launch time, not compute. Collectives are already timed with CUDA
events by the telemetry plugin; phases must be timed the same way, or the compute /
exposed-communication / host split of the bottleneck analysis compares two different clocks.

`PhaseTimer.wrap` records a CUDA event before and after each action handler (recording an event
queues a marker on the current stream: no synchronisation). `PhaseTimer.attach` hands each
phase span its `DeviceInterval` under `PhaseSpan.attributes[DEVICE_TIMING]`; whoever exports
the span (the telemetry plugin) waits until the end event has completed (`ready()`, which never
blocks) and then takes the device times (`times()`), placed on the wall clock through an anchor
event recorded with `time.time_ns()` at the start of the step. On CPU there is no timer and the
executor's host times are the phase times.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from plait.core.step import PhaseSpan

DEVICE_TIMING = "device_timing"
Handler = Callable[[Any], None]


@dataclass(frozen=True, slots=True)
class DeviceAnchor:
    """A device event paired with the wall clock when it was recorded, to place device times."""

    event: Any  # torch.cuda.Event
    wall_ns: int

    @classmethod
    def now(cls, cuda: Any) -> DeviceAnchor:
        event = cuda.Event(enable_timing=True)
        event.record()
        return cls(event=event, wall_ns=time.time_ns())


@dataclass(frozen=True, slots=True)
class DeviceInterval:
    """Events recorded around one action on the device's current stream."""

    start: Any
    end: Any
    anchor: DeviceAnchor

    def ready(self) -> bool:
        """True once the device has passed the end event (never blocks)."""
        return bool(self.end.query())

    def times(self) -> tuple[int, int]:
        """(start_ns, end_ns) on the wall clock; only once `ready()`."""
        anchor = self.anchor
        start_ms = anchor.event.elapsed_time(self.start)
        end_ms = anchor.event.elapsed_time(self.end)
        return anchor.wall_ns + int(start_ms * 1e6), anchor.wall_ns + int(end_ms * 1e6)


class PhaseTimer:
    """Times every action of one step with device events (`cuda` is `torch.cuda` or a fake)."""

    def __init__(self, cuda: Any) -> None:
        self.cuda = cuda
        self.anchor = DeviceAnchor.now(cuda)
        self.intervals: list[DeviceInterval] = []

    @classmethod
    def for_device(cls, device: Any) -> PhaseTimer | None:
        """A timer for a CUDA device; `None` where host times are device times (CPU)."""
        if getattr(device, "type", str(device).split(":")[0]) != "cuda":
            return None
        import torch

        return cls(torch.cuda)

    def wrap(self, handlers: Mapping[type, Handler]) -> dict[type, Handler]:
        return {kind: self._timed(handler) for kind, handler in handlers.items()}

    def _timed(self, handler: Handler) -> Handler:
        def timed(action: Any) -> None:
            start = self.cuda.Event(enable_timing=True)
            start.record()
            try:
                handler(action)
            finally:
                end = self.cuda.Event(enable_timing=True)
                end.record()
                self.intervals.append(DeviceInterval(start, end, self.anchor))

        return timed

    def attach(self, spans: Sequence[PhaseSpan]) -> list[PhaseSpan]:
        """The executor's spans (one per action, in order) with their device intervals."""
        if len(spans) != len(self.intervals):  # not one span per handler call: keep host times
            return list(spans)
        return [
            replace(span, attributes={**span.attributes, DEVICE_TIMING: interval})
            for span, interval in zip(spans, self.intervals, strict=True)
        ]


def device_interval(span: PhaseSpan) -> DeviceInterval | None:
    value = span.attributes.get(DEVICE_TIMING)
    return value if isinstance(value, DeviceInterval) else None
