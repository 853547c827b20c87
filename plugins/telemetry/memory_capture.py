"""`plait memory` on a rank: what the rank holds, metered over one step.

Asked for its memory, the rank meters the next step it runs, on the training thread:

* on CUDA, the caching allocator records its history (`torch.cuda.memory.
  _record_memory_history`) for that step, and the snapshot taken at its end
  (`torch.cuda.memory._snapshot()`) is delivered as the pickle PyTorch's memory viewer
  (https://pytorch.org/memory_viz) reads, with allocated, reserved and peak bytes;
* everywhere, the tensors autograd saves for backward pass through a `saved_tensors_hooks`
  pack hook that counts their distinct storages: the activations the step kept (regions under
  activation checkpointing save through their own hooks and are not seen);
* everywhere, the process's resident and peak resident memory, and the model state the engine
  counts from tensor storage (`JobInfo.memory_report`: parameters, gradients, optimizer state;
  read at the step's end, so gradients freed by `zero_grad(set_to_none=True)` count zero).

A rank that runs no step within the wait (stuck, or between runs) answers without the metered
figures and says so. Files are built and sent on a worker thread.
"""

from __future__ import annotations

import json
import logging
import pickle
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("plait.telemetry")

MAX_HISTORY_ENTRIES = 100_000


@dataclass
class MemoryOrder:
    request_id: str
    step_wait_seconds: float
    max_bytes: int
    asked_ns: int = field(default_factory=time.time_ns)


@dataclass
class Metering:
    order: MemoryOrder
    step: int
    saved: dict[int, int] = field(default_factory=dict)  # storage pointer -> bytes
    hooks: Any = None
    cuda_history: bool = False


@dataclass(frozen=True, slots=True)
class MemoryResult:
    order: MemoryOrder
    files: dict[str, bytes]
    first_step: int = -1
    error: str = ""


Deliver = Callable[[MemoryResult], None]
Accounting = Callable[[], dict[str, int]]


def _raises(exc: Exception) -> Callable[[], dict[str, int] | None]:
    def count() -> dict[str, int] | None:
        raise exc

    return count


def _saved_bytes(saved: dict[int, int]) -> Callable[[Any], Any]:
    def pack(tensor: Any) -> Any:
        try:
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, sparse)
            pass
        return tensor

    return pack


class MemoryCapture:
    """One rank's memory answers: metered on the training thread, built on a worker."""

    def __init__(self, *, device: str, deliver: Deliver, accounting: Accounting | None) -> None:
        self.device = device
        self._deliver = deliver
        self._accounting = accounting
        self.order: MemoryOrder | None = None  # armed: read at every step start
        self.metering: Metering | None = None
        self._working: set[str] = set()
        self._workers: set[threading.Thread] = set()  # building and delivering answers

    # -- the control channel's thread -----------------------------------------------------------

    def arm(self, order: MemoryOrder) -> None:
        if order.request_id in self._working or (
            self.order is not None and self.order.request_id == order.request_id
        ):
            return
        self._working.add(order.request_id)
        self.order = order

    def busy(self) -> list[str]:
        return [f"{r}:0" for r in self._working]

    def cancel(self, request_id: str) -> None:
        order = self.order
        if order is not None and order.request_id == request_id:
            self.order = None
        self._working.discard(request_id)

    def tick(self, now_ns: int) -> None:
        """No step came within the wait: answer with what can be had without one."""
        order = self.order
        if order is None or (now_ns - order.asked_ns) / 1e9 < order.step_wait_seconds:
            return
        self.order = None
        note = f"no step started within {order.step_wait_seconds:g}s: nothing metered"
        self._finish(
            Metering(order, step=-1),
            note=note,
            snapshot=self._cuda_snapshot(False),
            model_state=self._accounting,
        )

    # -- the training thread --------------------------------------------------------------------

    def step_started(self, step: int) -> None:
        order = self.order
        if order is None or self.metering is not None:
            return
        self.order = None
        import torch

        metering = Metering(order, step)
        if self.device.startswith("cuda"):
            torch.cuda.memory._record_memory_history(max_entries=MAX_HISTORY_ENTRIES)
            metering.cuda_history = True
        metering.hooks = torch.autograd.graph.saved_tensors_hooks(
            _saved_bytes(metering.saved), lambda tensor: tensor
        )
        metering.hooks.__enter__()
        self.metering = metering

    def step_finished(self, step: int) -> None:
        metering = self.metering
        if metering is None:
            return
        self.metering = None
        metering.hooks.__exit__(None, None, None)
        snapshot = self._cuda_snapshot(metering.cuda_history)
        # Counted here, between steps: the parameters and optimizer state are not changing.
        # A count that fails is the operator's answer (an error), never the training loop's.
        try:
            state = self._accounting() if self._accounting is not None else None
        except Exception as exc:
            self._finish(metering, note="", snapshot=snapshot, model_state=_raises(exc))
            return
        self._finish(metering, note="", snapshot=snapshot, model_state=lambda: state)

    def _cuda_snapshot(self, recording: bool) -> dict[str, Any] | None:
        if not self.device.startswith("cuda"):
            return None
        import torch

        snapshot = torch.cuda.memory._snapshot()
        if recording:
            torch.cuda.memory._record_memory_history(enabled=None)
        return snapshot

    # -- the worker thread ----------------------------------------------------------------------

    def _finish(
        self,
        metering: Metering,
        *,
        note: str,
        snapshot: dict[str, Any] | None,
        model_state: Callable[[], dict[str, int] | None] | None,
    ) -> None:
        def run() -> None:
            order = metering.order
            try:
                state = model_state() if model_state is not None else None
                report = self._report(metering, note, state)
                files = {"memory.json": json.dumps(report).encode()}
                if snapshot is not None:
                    files["snapshot.pickle"] = pickle.dumps(snapshot)
                size = sum(len(data) for data in files.values())
                if size > order.max_bytes:
                    result = MemoryResult(
                        order, {}, error=f"the snapshot is {size / 2**20:.1f} MiB, over the "
                        f"daemon's {order.max_bytes / 2**20:.0f} MiB"
                    )  # fmt: skip
                else:
                    result = MemoryResult(order, files, first_step=metering.step)
            except Exception as exc:  # reported to the operator, not raised
                logger.exception("plait memory: building the report failed")
                result = MemoryResult(order, {}, error=f"building the report failed: {exc}")
            try:
                self._deliver(result)
            finally:
                self._working.discard(order.request_id)
                self._workers.discard(threading.current_thread())

        worker = threading.Thread(target=run, name="plait-memory", daemon=True)
        self._workers.add(worker)
        worker.start()

    def wait(self, timeout: float) -> None:
        """The run ends: let answers under way reach the daemon (at most `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        for worker in list(self._workers):
            worker.join(timeout=max(deadline - time.monotonic(), 0.0))

    def _report(
        self, metering: Metering, note: str, model_state: dict[str, int] | None
    ) -> dict[str, Any]:
        import psutil

        report: dict[str, Any] = {
            "device": self.device,
            "step": metering.step,
            "note": note,
            "rss_bytes": psutil.Process().memory_info().rss,
            # ru_maxrss is in KiB on Linux.
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "model_state": model_state,
            "activations_saved_bytes": sum(metering.saved.values()) if metering.step >= 0 else None,
            "activations_saved_tensors": len(metering.saved) if metering.step >= 0 else None,
        }
        if self.device.startswith("cuda"):
            import torch

            device = torch.device(self.device)
            report["cuda"] = {
                "allocated_bytes": torch.cuda.memory_allocated(device),
                "reserved_bytes": torch.cuda.memory_reserved(device),
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "snapshot": "snapshot.pickle (open in https://pytorch.org/memory_viz)",
            }
        return report
