"""`torch.profiler` on demand, started and stopped at step boundaries.

Three threads take part, and the training thread does only what must happen on it:

* the control channel's thread (the span exporter's) receives the orders: it *prepares* a
  profiler on a worker thread (`prepare_trace`: the first one in a process initialises Kineto,
  which takes seconds and mostly runs without the GIL) and reports it ready; later it *arms*
  a plan (start step, steps to record);
* the training thread, at every step start, reads one attribute: with a plan armed, at the
  start step it starts the prepared profiler (`start_trace`, thread-local callbacks: this is
  the thread whose operators are recorded, and the autograd and backend threads it hands work
  to) and wraps each step in a `ProfilerStep#N` annotation (PyTorch's own name, with plait's
  step number, so every tool finds the steps); after the last step it stops the profiler;
* a worker thread exports the trace (Chrome JSON, as PyTorch writes it), compresses it and
  delivers it in chunks, after flushing the span exporter so the daemon holds plait's spans of
  those steps before it merges.

A rank already past the start step when the plan arrives reports a miss instead of recording
other steps than its peers. On CUDA the profiler also records kernels, memory copies and sets
through CUPTI.
"""

from __future__ import annotations

import gzip
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("plait.telemetry")

STEP_ANNOTATION = "ProfilerStep#{}"  # torch.profiler's own step annotation
EXPORT_WAIT_SECONDS = 60.0  # how long the end of a run waits for a trace to be delivered


@dataclass(frozen=True, slots=True)
class ProfilePlan:
    request_id: str
    plan: int
    start_step: int
    steps: int  # 0: stop after `seconds`
    seconds: float
    with_stack: bool = False
    record_shapes: bool = False
    max_bytes: int = 64 * 2**20

    @property
    def ack(self) -> str:
        return f"{self.request_id}:{self.plan}"


@dataclass
class Recording:
    """A profile the training thread is recording."""

    plan: ProfilePlan
    profiler: Any
    first_step: int
    started_ns: int
    annotation: Any = None
    last_step: int = -1


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """A finished capture to deliver: the compressed trace, or why there is none."""

    plan: ProfilePlan
    trace_gz: bytes = b""
    first_step: int = -1
    last_step: int = -1
    error: str = ""
    missed: bool = False


Deliver = Callable[[ProfileResult], None]


def new_profiler(device: str, *, with_stack: bool, record_shapes: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities, with_stack=with_stack, record_shapes=record_shapes)


def export_trace(profiler: Any) -> bytes:
    """The profiler's Chrome trace, gzip-compressed (written to a temporary file by PyTorch)."""
    handle, path = tempfile.mkstemp(prefix="plait-profile-", suffix=".json")
    os.close(handle)
    try:
        profiler.export_chrome_trace(path)
        with open(path, "rb") as f:
            return gzip.compress(f.read(), compresslevel=6)
    finally:
        os.unlink(path)


class ProfileCapture:
    """One rank's on-demand profiler: prepared and exported off the training thread, started
    and stopped on it."""

    def __init__(self, *, device: str, deliver: Deliver) -> None:
        self.device = device
        self._deliver = deliver
        self._lock = threading.Lock()
        self._prepared: dict[str, Any] = {}  # request id -> a prepared profiler
        self._preparing: set[str] = set()
        self._ready: set[str] = set()
        self._exporting: set[str] = set()
        self._cancelled: set[str] = set()  # requests the daemon gave up on
        self._exports: set[threading.Thread] = set()  # delivering, waited for at `stop`
        # Read by the training thread at every step boundary: one attribute each.
        self.plan: ProfilePlan | None = None
        self.recording: Recording | None = None

    # -- the control channel's thread -----------------------------------------------------------

    def prepare(self, request_id: str, *, with_stack: bool, record_shapes: bool) -> None:
        """Build and prepare a profiler on a worker thread; `ready()` lists it once done."""
        with self._lock:
            if request_id in self._preparing or request_id in self._ready:
                return
            self._preparing.add(request_id)

        def run() -> None:
            try:
                profiler = new_profiler(
                    self.device, with_stack=with_stack, record_shapes=record_shapes
                )
                profiler.prepare_trace()
            except Exception:  # a profiler that cannot start: the daemon hears "not ready"
                logger.exception("plait profile: preparing torch.profiler failed")
                with self._lock:
                    self._preparing.discard(request_id)
                return
            with self._lock:
                self._preparing.discard(request_id)
                if request_id not in self._cancelled:
                    self._prepared[request_id] = profiler
                    self._ready.add(request_id)

        threading.Thread(target=run, name="plait-profile-prepare", daemon=True).start()

    def ready(self) -> list[str]:
        with self._lock:
            return sorted(self._ready)

    def busy(self) -> list[str]:
        """Acknowledgements of the orders in progress ("request:plan")."""
        with self._lock:
            acks = [f"{r}:0" for r in (*self._preparing, *self._ready)]
            acks += [f"{r}:0" for r in self._exporting]
        plan, recording = self.plan, self.recording
        if plan is not None:
            acks.append(plan.ack)
        if recording is not None:
            acks.append(recording.plan.ack)
        return acks

    def arm(self, plan: ProfilePlan, current_step: int) -> None:
        """Record `plan` from its start step; a rank already past it reports a miss at once.

        NOTE: only a step *after* the start step proves a miss here; at the start step itself
        the training thread may or may not have seen the plan, and decides at the next start.
        """
        recording = self.recording
        if recording is not None and recording.plan.ack == plan.ack:
            return
        if self.plan is not None and self.plan.ack == plan.ack:
            return
        self.plan = plan
        if current_step > plan.start_step and (recording is None or recording.plan != plan):
            self.plan = None
            self._deliver(
                ProfileResult(
                    plan,
                    first_step=current_step,
                    error=f"already at step {current_step} when asked to start at step "
                    f"{plan.start_step}",
                    missed=True,
                )
            )

    def cancel(self, request_id: str) -> None:
        """Forget a request: its plan, its prepared profiler (a recording stops at the next
        step end and is dropped)."""
        plan = self.plan
        if plan is not None and plan.request_id == request_id:
            self.plan = None
        with self._lock:
            self._cancelled.add(request_id)
            self._ready.discard(request_id)
            self._prepared.pop(request_id, None)

    # -- the training thread --------------------------------------------------------------------

    def step_started(self, step: int) -> None:
        recording = self.recording
        if recording is not None:
            recording.annotation = _enter_step(step)
            return
        plan = self.plan
        if plan is None or step < plan.start_step:
            return
        self.plan = None
        if step > plan.start_step:
            self._deliver(
                ProfileResult(
                    plan,
                    first_step=step,
                    error=f"reached step {step} before starting at step {plan.start_step}",
                    missed=True,
                )
            )
            return
        with self._lock:
            profiler = self._prepared.pop(plan.request_id, None)
            self._ready.discard(plan.request_id)
        if profiler is None:
            # Prepared once already (a plan replaced after a miss): Kineto is initialised, so
            # preparing again takes about a millisecond.
            profiler = new_profiler(
                self.device, with_stack=plan.with_stack, record_shapes=plan.record_shapes
            )
            profiler.prepare_trace()
        profiler.start_trace()
        self.recording = Recording(plan, profiler, first_step=step, started_ns=time.time_ns())
        self.recording.annotation = _enter_step(step)

    def step_finished(self, step: int) -> None:
        recording = self.recording
        if recording is None:
            return
        if recording.annotation is not None:
            recording.annotation.__exit__(None, None, None)
            recording.annotation = None
        recording.last_step = step
        plan = recording.plan
        replaced = self.plan is not None and self.plan.request_id == plan.request_id
        cancelled = replaced or plan.request_id in self._cancelled
        recorded = step - recording.first_step + 1
        elapsed = (time.time_ns() - recording.started_ns) / 1e9
        done = recorded >= plan.steps if plan.steps else elapsed >= plan.seconds
        if not (done or cancelled):
            return
        self.recording = None
        recording.profiler.stop_trace()
        if not cancelled:
            self._export(recording)

    def stop(self, timeout: float = EXPORT_WAIT_SECONDS) -> None:
        """The run ends: a recording in progress is stopped and delivered with the steps it
        holds, and deliveries still under way are waited for (at most `timeout` seconds in
        all), so that a run ending right after its capture still delivers it (called on the
        thread that ends the run, at shutdown)."""
        recording = self.recording
        if recording is not None:
            if recording.annotation is not None:
                recording.annotation.__exit__(None, None, None)
            self.recording = None
            recording.profiler.stop_trace()
            if recording.last_step >= recording.first_step:
                self._export(recording)
        deadline = time.monotonic() + timeout
        for worker in list(self._exports):
            worker.join(timeout=max(deadline - time.monotonic(), 0.0))

    # -- the worker thread ----------------------------------------------------------------------

    def _export(self, recording: Recording) -> None:
        plan = recording.plan
        with self._lock:
            self._exporting.add(plan.request_id)

        def run() -> None:
            try:
                trace = export_trace(recording.profiler)
                if len(trace) > plan.max_bytes:
                    result = ProfileResult(
                        plan,
                        error=f"the trace is {len(trace) / 2**20:.1f} MiB compressed, over the "
                        f"daemon's {plan.max_bytes / 2**20:.0f} MiB: record fewer steps",
                    )
                else:
                    result = ProfileResult(
                        plan, trace, first_step=recording.first_step, last_step=recording.last_step
                    )
            except Exception as exc:  # reported to the operator, not raised
                logger.exception("plait profile: exporting the trace failed")
                result = ProfileResult(plan, error=f"exporting the trace failed: {exc}")
            try:
                self._deliver(result)
            finally:
                with self._lock:
                    self._exporting.discard(plan.request_id)
                self._exports.discard(threading.current_thread())

        worker = threading.Thread(target=run, name="plait-profile-export", daemon=True)
        self._exports.add(worker)
        worker.start()


def _enter_step(step: int) -> Any:
    from torch.autograd.profiler import record_function

    annotation = record_function(STEP_ANNOTATION.format(step))
    annotation.__enter__()
    return annotation
