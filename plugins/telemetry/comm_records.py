"""Timing of collective and point-to-point ops for telemetry, without device synchronisation.

`CommRecord` is what the telemetry wrapper keeps per op while a step runs: plain scalars (no
tensor references, so buffers are not kept alive) and a start/end time. An op ends

* for a synchronous op, when the hook returns;
* for an asynchronous op, when the caller's `wait()` on its work returns (`TimedWork`), or
  earlier, when a later op's issue finds its work completed (the telemetry plugin asks every
  unwaited op then), or, for an op nobody waits on, when the step's records are collected and
  its work reports completion (`done`);
* on CUDA, at CUDA events recorded around the op and read after the step (`resolve_cuda`), so
  the timing is the device's, and no `synchronize()` is ever added to the step.

NOTE: an asynchronous op's end is deliberately *not* taken from a completion callback
(`Work.get_future().then(...)`): the backend runs such a callback on its own thread, which
must take the GIL from the training thread once per collective — the largest cost telemetry
had on a step. Asking `is_completed()` at the next issue bounds an op's end by that issue
instead, so a bucket's all-reduce that ran under backward is not stretched to the wait after
backward, which counted the compute it hid under as communication.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from plait.core.records import CommRequest


@dataclass(slots=True)
class CudaAnchor:
    """A CUDA event paired with the wall clock when it was recorded, to place device times."""

    event: Any  # torch.cuda.Event
    wall_ns: int

    @classmethod
    def now(cls) -> CudaAnchor:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return cls(event=event, wall_ns=time.time_ns())


@dataclass(slots=True)
class CommRecord:
    """One op: what it was, and when it ran (end_ns stays 0 until it completes)."""

    op: str
    nbytes: int
    dtype: Any  # torch.dtype or None
    group_name: str
    group_ranks: tuple[int, ...]
    seq: int
    purpose: str
    peer: int | None
    async_op: bool
    step: int | None
    start_ns: int
    end_ns: int = 0
    error: str = ""
    cuda_start: Any = None
    cuda_end: Any = None
    anchor: CudaAnchor | None = None
    work: Any = None  # an async op's handle until it finishes, to ask whether it completed
    algorithm: str = ""  # what carried the op out (plait.core.comm.CARRIED_BY), "" unknown
    links: Any = None  # plait.core.link_bytes.LinkBytes this rank sent, None when unknown

    @classmethod
    def begin(cls, request: CommRequest, step: int | None) -> CommRecord:
        # Runs on the training thread once per op: positional arguments and a single operand's
        # `nbytes` read directly cost a third of the keyword call with `CommRequest.nbytes`'s
        # generic sum (1.1 µs instead of 3.9 on the shared development machine).
        tensors = request.tensors
        first = tensors[0] if tensors else None
        return cls(
            request.op,  # op
            first.nbytes if len(tensors) == 1 else request.nbytes,  # nbytes
            first.dtype if first is not None else None,  # dtype
            request.group_name,  # group_name
            request.group_ranks,  # group_ranks
            request.seq,  # seq
            request.purpose,  # purpose
            request.peer,  # peer
            request.async_op,  # async_op
            step,  # step
            time.time_ns(),  # start_ns
        )

    @property
    def done(self) -> bool:
        """Finished; an async op that nobody waited on is finished here once its work reports
        completion (host-timed ops only: on CUDA an end event recorded now would also wait for
        whatever the stream queued since)."""
        if self.end_ns == 0 and self.work is not None and self.cuda_start is None:
            completed = getattr(self.work, "is_completed", None)
            if completed is not None and completed():
                self.finish()
        if self.cuda_start is not None:
            return self.cuda_end is not None and self.end_ns != 0
        return self.end_ns != 0

    def finish(self) -> None:
        """Mark the op complete now (host clock; the CUDA end event, if any, is recorded too)."""
        if self.cuda_start is not None and self.cuda_end is None:
            import torch

            # The caller's stream waits for the collective at this point (after `wait()` or in a
            # future callback), so an event recorded here completes when the op does.
            self.cuda_end = torch.cuda.Event(enable_timing=True)
            self.cuda_end.record()
        if self.end_ns == 0:
            self.end_ns = time.time_ns()
        self.work = None

    def start_cuda(self, anchor: CudaAnchor) -> None:
        import torch

        self.anchor = anchor
        self.cuda_start = torch.cuda.Event(enable_timing=True)
        self.cuda_start.record()

    def resolve_cuda(self) -> bool:
        """Replace host times by device times if the end event has completed; never blocks."""
        if self.cuda_start is None or self.anchor is None:
            return True
        if self.cuda_end is None or not self.cuda_end.query():
            return False
        anchor = self.anchor
        start_ms = anchor.event.elapsed_time(self.cuda_start)
        end_ms = anchor.event.elapsed_time(self.cuda_end)
        self.start_ns = anchor.wall_ns + int(start_ms * 1e6)
        self.end_ns = anchor.wall_ns + int(end_ms * 1e6)
        self.cuda_start = self.cuda_end = self.anchor = None
        return True


class TimedWork:
    """Wraps an async op's `Work`: the record completes when `wait()` returns."""

    __slots__ = ("_record", "_work")

    def __init__(self, work: Any, record: CommRecord) -> None:
        self._work = work
        self._record = record

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._work.wait(*args, **kwargs)
        except BaseException as exc:
            self._record.error = self._record.error or f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._record.finish()

    def is_completed(self) -> bool:
        completed = getattr(self._work, "is_completed", None)
        return bool(completed()) if completed is not None else self._record.done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def track_async_completion(work: Any, record: CommRecord) -> TimedWork:
    """Arrange for `record` to finish when `work` is waited on (or found complete at step end);
    return the handle to give back. Nothing runs on the backend's threads."""
    record.work = work
    return TimedWork(work, record)
