"""The phases of an observed step, from hooks: data, forward, backward and optimizer, on the
host clock or — on a GPU — on device events, so that phases and collectives share one clock.

A step runs from the end of the step before it (the first: from its `begin`) to its `end`;
the first forward splits it:

    | data (the batch, anything between steps) | forward | backward | ... | optimizer |

Marks are taken by the observer's hooks (`Observer` in `plait.plugins.telemetry.observe`):
a forward pre/post hook on the model, a gradient hook on the forward's outputs (backward
starts when the first output gradient is computed) with an autograd-engine callback for its
end, and optimizer step pre/post hooks. On a GPU each mark also records a CUDA event on the
current stream (no synchronisation): phases carry a `DeviceInterval` that the span exporter
reads once the device has passed it, and the step's own start and end are read the same way
when its report is built (`StepTimeline.ready`), so the step time is the device's.

Device times are placed on the wall clock through an anchor: an event recorded while the
device is idle (once, after one synchronisation when the first step begins; then again at any
step that begins with the stream idle, which a loop that reads its loss every step gives each
step), so that the anchor's wall time is also when the device passed it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from plait.core.phase_timing import DEVICE_TIMING, DeviceAnchor, DeviceInterval
from plait.core.step import PhaseSpan


@dataclass(frozen=True, slots=True)
class Mark:
    """A moment of the step: host wall time, and on a GPU an event recorded on the stream."""

    host_ns: int
    event: Any = None


class StepClock:
    """Takes marks; `cuda` is `torch.cuda` (or a stand-in with its names) on a GPU, else None."""

    def __init__(self, cuda: Any = None) -> None:
        self.cuda = cuda
        self.anchor: DeviceAnchor | None = None

    def anchor_if_idle(self) -> None:
        """Re-anchor when the stream has drained (the first time: drain it, once)."""
        cuda = self.cuda
        if cuda is None:
            return
        if self.anchor is None:
            cuda.synchronize()
        elif not cuda.current_stream().query():
            return
        self.anchor = DeviceAnchor.now(cuda)

    def mark(self) -> Mark:
        if self.cuda is None:
            return Mark(time.time_ns())
        event = self.cuda.Event(enable_timing=True)
        event.record()
        return Mark(time.time_ns(), event)


@dataclass(slots=True)
class StepTimeline:
    """The marks and phases of one step (filled by hooks, read at its end)."""

    number: int
    clock: StepClock
    start: Mark  # the previous step's end, or this step's begin
    anchor: DeviceAnchor | None = None  # the clock's when the step began (GPU)
    phases: list[PhaseSpan] = field(default_factory=list)
    end: Mark | None = None
    data_end: Mark | None = None
    forward_start: Mark | None = None
    backward_start: Mark | None = None
    optimizer_start: Mark | None = None
    forwards: int = 0
    backwards: int = 0

    def _phase(self, name: str, start: Mark, end: Mark, microbatch: int | None = None) -> None:
        interval = None
        if start.event is not None and end.event is not None and self.anchor is not None:
            interval = DeviceInterval(start.event, end.event, self.anchor)
        self.phases.append(
            PhaseSpan(
                name=name,
                start_ns=start.host_ns,
                end_ns=max(end.host_ns, start.host_ns),
                microbatch=microbatch,
                attributes={DEVICE_TIMING: interval} if interval is not None else {},
            )
        )

    def forward_started(self) -> None:
        mark = self.clock.mark()
        if self.data_end is None:
            self.data_end = mark
            self._phase("data", self.start, mark)
        self.forward_start = mark

    def forward_finished(self) -> int | None:
        """The micro-batch index of the forward that ended (None: no forward was open)."""
        if self.forward_start is None:
            return None
        self._phase("forward", self.forward_start, self.clock.mark(), self.forwards)
        self.forward_start = None
        self.forwards += 1
        return self.forwards - 1

    def backward_started(self) -> None:
        if self.backward_start is None:
            self.backward_start = self.clock.mark()

    def backward_finished(self) -> None:
        if self.backward_start is None:
            return
        self._phase("backward", self.backward_start, self.clock.mark(), self.backwards)
        self.backward_start = None
        self.backwards += 1

    def optimizer_started(self) -> None:
        self.optimizer_start = self.clock.mark()

    def optimizer_finished(self) -> None:
        if self.optimizer_start is None:
            return
        self._phase("optimizer", self.optimizer_start, self.clock.mark())
        self.optimizer_start = None

    def finish(self) -> Mark:
        self.end = self.clock.mark()
        if self.data_end is None:  # no forward: the whole step waited for nothing observable
            self.data_end = self.end
        return self.end

    # -- once the step is over -------------------------------------------------------------------

    def ready(self) -> bool:
        """The device has passed the step's end (always, on the host clock)."""
        return self.end is not None and (self.end.event is None or bool(self.end.event.query()))

    def bounds_ns(self) -> tuple[int, int, int]:
        """(start, data end, end) on the wall clock; device times on a GPU, once `ready()`."""
        assert self.end is not None and self.data_end is not None
        marks = (self.start, self.data_end, self.end)
        anchor = self.anchor
        if anchor is None or any(m.event is None for m in marks):
            return marks[0].host_ns, marks[1].host_ns, marks[2].host_ns
        placed = [anchor.wall_ns + int(anchor.event.elapsed_time(m.event) * 1e6) for m in marks]
        return placed[0], placed[1], placed[2]
