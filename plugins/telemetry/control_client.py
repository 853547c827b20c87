"""The control channel's rank side: poll the node daemon, answer what it asks.

`RankTelemetry` builds one `ControlClient` per rank, over the channel its spans go through.
Three seams, one per thread:

* **the span exporter's thread** calls `tick()` each time it wakes: at most every poll interval
  (`$PLAIT_CONTROL_POLL_MS`, default 500) it polls the daemon with who the rank is (job, replica
  group in a fault-tolerant job, rank), the step it is in and its clock estimate, and takes the
  orders waiting: stacks are taken and sent right there (`plait.plugins.telemetry.stacks`), a
  profile or memory capture is handed to `ProfileCapture` / `MemoryCapture`;
* **the training thread** tells it where step boundaries are: the telemetry plugin writes
  `step` and reads `armed` in its step hooks, and calls `step_started` / `step_finished` only
  when a capture is armed (another loop calls those two at every step); when nothing was
  asked, a step costs an attribute write and two attribute reads, no call;
* **worker threads** export captures and deliver them in chunks (`Deliver` calls of at most the
  daemon's chunk size), after flushing the span exporter so plait's spans of the recorded steps
  reach the daemon first.

Anything that uses the telemetry exporter gets the channel: it is part of `RankTelemetry`, not
of the engine; a loop the engine does not drive calls the two step methods itself.

**Clock offset.** Each poll measures the daemon's clock against this rank's, NTP's way: the
daemon stamps its reply, and the offset is that stamp minus the middle of the round trip; of
the last `CLOCK_SAMPLES` polls the one with the shortest trip wins (its error is at most half
of it). The estimate travels with every poll and delivery; the daemon moves the rank's trace by
it when merging ranks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import grpc

from plait.plugins.telemetry.heartbeat import InflightComm
from plait.plugins.telemetry.memory_capture import MemoryCapture, MemoryOrder, MemoryResult
from plait.plugins.telemetry.profile_capture import ProfileCapture, ProfilePlan, ProfileResult
from plait.plugins.telemetry.stacks import stacks_json
from plait.proto.plait.v1 import control_pb2, control_pb2_grpc

if TYPE_CHECKING:
    from plait.core.step import JobInfo
    from plait.plugins.telemetry.job_nodes import JobNodes

logger = logging.getLogger("plait.telemetry")

POLL_ENV = "PLAIT_CONTROL_POLL_MS"
POLL_INTERVAL_SECONDS = 0.5
CLOCK_SAMPLES = 16
CALL_TIMEOUT_SECONDS = 2.0
DELIVER_TIMEOUT_SECONDS = 10.0
DEFAULT_CHUNK_BYTES = 2**20
FLUSH_BEFORE_DELIVERY_SECONDS = 5.0
# At the end of a run, how long deliveries under way (a trace exported after the last step of
# a capture, a memory report) are waited for before the daemon hears the rank leave.
CLOSE_WAIT_SECONDS = 60.0


def poll_interval() -> float:
    value = os.environ.get(POLL_ENV, "")
    return int(value) / 1000 if value.isdigit() and int(value) > 0 else POLL_INTERVAL_SECONDS


class ClockEstimate:
    """The daemon's clock minus this rank's, from the recent poll with the shortest round trip."""

    def __init__(self, samples: int = CLOCK_SAMPLES) -> None:
        self._samples: deque[tuple[int, int]] = deque(maxlen=samples)  # (rtt, offset)

    def add(self, sent_ns: int, daemon_ns: int, received_ns: int) -> None:
        rtt = received_ns - sent_ns
        if rtt >= 0 and daemon_ns > 0:
            self._samples.append((rtt, daemon_ns - (sent_ns + received_ns) // 2))

    @property
    def best(self) -> tuple[int, int]:
        """(offset ns, round trip ns); (0, 0) before any poll came back."""
        if not self._samples:
            return 0, 0
        rtt, offset = min(self._samples)
        return offset, rtt


class ControlClient:
    """Polls the node daemon for orders and answers them, off the training thread."""

    def __init__(
        self,
        *,
        channel: grpc.Channel,
        info: JobInfo,
        flush_spans: Callable[[float], object],
        inflight: Callable[[], Sequence[InflightComm]] | None = None,
        interval: float | None = None,
    ) -> None:
        self.info = info
        self.interval = poll_interval() if interval is None else interval
        self._stub = control_pb2_grpc.ControlStub(channel)
        self._flush_spans = flush_spans
        self.inflight = inflight
        self.clock = ClockEstimate()
        self.profile = ProfileCapture(device=info.device, deliver=self._deliver_profile)
        self.memory = MemoryCapture(
            device=info.device, deliver=self._deliver_memory, accounting=info.memory_report
        )
        # Written by the training thread at every step start; `armed` is read there (when it is
        # False, as it is unless a capture was asked for, a step boundary costs nothing more).
        self.step = -1
        self.training_thread: int | None = threading.get_ident()  # built where the job starts
        self.armed = False
        self._arm_lock = threading.Lock()
        self._last_poll = 0.0
        self._chunk_bytes = DEFAULT_CHUNK_BYTES
        self._failed = False  # the last poll failed: warn once per outage
        self._disabled = False  # the daemon has no control service
        self._stacks_sent: deque[str] = deque(maxlen=64)
        self.polls = 0
        # The job's nodes (`job_nodes.gather_job_nodes`), sent by a node's first rank with its
        # first poll and whenever the daemon says it has none (it restarted).
        self.job_nodes: JobNodes | None = None
        self._send_job_nodes = True

    # -- the training thread --------------------------------------------------------------------

    def step_started(self, step: int) -> None:
        self.step = step
        self.training_thread = threading.get_ident()
        if not self.armed:
            return
        profile = self.profile
        if profile.plan is not None or profile.recording is not None:
            profile.step_started(step)
        if self.memory.order is not None:
            self.memory.step_started(step)
        self._rearm()

    def step_finished(self, step: int) -> None:
        if not self.armed:
            return
        if self.profile.recording is not None:
            self.profile.step_finished(step)
        if self.memory.metering is not None:
            self.memory.step_finished(step)
        self._rearm()

    def _rearm(self) -> None:
        """`armed`: whether a step boundary has anything to do (either thread, under the lock,
        so an order armed meanwhile is never cleared)."""
        profile, memory = self.profile, self.memory
        with self._arm_lock:
            self.armed = (
                profile.plan is not None
                or profile.recording is not None
                or memory.order is not None
                or memory.metering is not None
            )

    # -- the exporter thread --------------------------------------------------------------------

    def tick(self) -> None:
        """Poll if the interval has passed, and act on the orders that came back."""
        now = time.monotonic()
        # 0.9: the exporter wakes about every interval; a wake a hair early must not skip one.
        if self._disabled or now - self._last_poll < 0.9 * self.interval:
            return
        self._last_poll = now
        self.memory.tick(time.time_ns())
        for order in self.poll():
            self._handle(order)
        self._rearm()

    @property
    def _replica_group(self) -> int | None:
        """The rank's replica group as the messages carry it: unset outside fault tolerance
        (two groups' rank 0 on one node are two endpoints only if the daemon hears the group)."""
        group = self.info.replica_group
        return group if group >= 0 else None

    def poll(self, *, leaving: bool = False) -> list[control_pb2.RankOrder]:
        info = self.info
        offset, rtt = self.clock.best
        request = control_pb2.PollRequest(
            job_id=info.job_id,
            rank=info.rank,
            world_size=info.world_size,
            host=info.host,
            pid=os.getpid(),
            device=info.device,
            coordinates=info.coordinates,
            step=self.step,
            clock_offset_nano=offset,
            clock_rtt_nano=rtt,
            busy=[*self.profile.busy(), *self.memory.busy()],
            ready=self.profile.ready(),
            leaving=leaving,
            replica_group=self._replica_group,
        )
        nodes = self.job_nodes
        carries_nodes = nodes is not None and nodes.reporter and self._send_job_nodes
        if carries_nodes:
            assert nodes is not None
            request.job_nodes.extend(nodes.nodes)
            request.self_node = nodes.self_node
        sent = time.time_ns()
        try:
            response = self._stub.Poll(request, timeout=CALL_TIMEOUT_SECONDS)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._disabled = True
                logger.warning("plait telemetry: the daemon has no control channel (older plait)")
            elif not self._failed:
                logger.warning("plait telemetry: polling the daemon failed: %s", exc.code())
            self._failed = True
            return []
        self.clock.add(sent, response.daemon_unix_nano, time.time_ns())
        self._failed = False
        self.polls += 1
        self._chunk_bytes = response.max_chunk_bytes or DEFAULT_CHUNK_BYTES
        self._send_job_nodes = response.wants_job_nodes and not carries_nodes
        return list(response.orders)

    def _handle(self, order: control_pb2.RankOrder) -> None:
        which = order.WhichOneof("order")
        if which == "stacks":
            # An order repeats until the daemon sees an answer; answer each request once.
            if order.request_id not in self._stacks_sent:
                self._stacks_sent.append(order.request_id)
                self._deliver(order.request_id, 0, {"stacks.json": self._stacks()})
        elif which == "profile":
            self._handle_profile(order.request_id, order.profile)
        elif which == "memory":
            self.memory.arm(
                MemoryOrder(
                    order.request_id,
                    step_wait_seconds=order.memory.step_wait_seconds,
                    max_bytes=order.memory.max_bytes or 64 * 2**20,
                )
            )
        elif which == "cancel":
            self.profile.cancel(order.request_id)
            self.memory.cancel(order.request_id)

    def _stacks(self) -> bytes:
        return stacks_json(
            training_thread=self.training_thread, step=self.step, inflight=self.inflight
        )

    def _handle_profile(self, request_id: str, order: control_pb2.ProfileOrder) -> None:
        if order.plan == 0:
            self.profile.prepare(
                request_id, with_stack=order.with_stack, record_shapes=order.record_shapes
            )
            return
        self.profile.arm(
            ProfilePlan(
                request_id=request_id,
                plan=order.plan,
                start_step=order.start_step,
                steps=order.steps,
                seconds=order.seconds,
                with_stack=order.with_stack,
                record_shapes=order.record_shapes,
                max_bytes=order.max_bytes or 64 * 2**20,
            ),
            current_step=self.step,
        )

    # -- deliveries (worker threads, or the exporter thread for stacks) -------------------------

    def _deliver_profile(self, result: ProfileResult) -> None:
        plan = result.plan
        if not result.error:
            self._flush_spans(FLUSH_BEFORE_DELIVERY_SECONDS)
        self._deliver(
            plan.request_id,
            plan.plan,
            {"trace.json.gz": result.trace_gz} if not result.error else {},
            error=result.error,
            missed=result.missed,
            first_step=result.first_step,
            last_step=result.last_step,
        )

    def _deliver_memory(self, result: MemoryResult) -> None:
        self._deliver(
            result.order.request_id,
            0,
            result.files,
            error=result.error,
            first_step=result.first_step,
            last_step=result.first_step,
        )

    def _deliver(
        self,
        request_id: str,
        plan: int,
        parts: dict[str, bytes],
        *,
        error: str = "",
        missed: bool = False,
        first_step: int = -1,
        last_step: int = -1,
    ) -> bool:
        """Send `parts` in chunks (or `error` alone); False if the daemon refused one."""
        info = self.info
        offset, rtt = self.clock.best
        chunks = [
            (name, data[start : start + self._chunk_bytes])
            for name, data in parts.items()
            for start in range(0, max(len(data), 1), self._chunk_bytes)
        ] or [("", b"")]
        total = sum(len(data) for data in parts.values())
        for index, (name, data) in enumerate(chunks):
            chunk = control_pb2.DeliverChunk(
                request_id=request_id,
                job_id=info.job_id,
                rank=info.rank,
                plan=plan,
                part=name,
                index=index,
                data=data,
                last=index == len(chunks) - 1,
                total_bytes=total,
                replica_group=self._replica_group,
                error=error,
                missed=missed,
                first_step=first_step,
                last_step=last_step,
                clock_offset_nano=offset,
                clock_rtt_nano=rtt,
            )
            try:
                ack = self._stub.Deliver(chunk, timeout=DELIVER_TIMEOUT_SECONDS)
            except grpc.RpcError as exc:
                logger.warning("plait telemetry: delivering %s failed: %s", request_id, exc.code())
                return False
            if not ack.accepted:
                logger.warning("plait telemetry: the daemon refused %s: %s", request_id, ack.reason)
                return False
        return True

    def close(self) -> None:
        """The run ends: a profile in progress is delivered with the steps it holds, answers
        still being delivered are let through, and the daemon is told this rank is leaving
        (called on the thread that ends the run)."""
        deadline = time.monotonic() + CLOSE_WAIT_SECONDS
        self.profile.stop(CLOSE_WAIT_SECONDS)
        self.memory.wait(max(deadline - time.monotonic(), 0.0))
        if not (self._disabled or self._failed):  # a daemon already gone costs no timeout
            self.poll(leaving=True)
