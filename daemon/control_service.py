"""The `plait.v1.Control` gRPC service: translates the control registry and the capture analysis.

Who may ask what, and what a request becomes, is decided in `plait.daemon.control` (no gRPC);
what ranks send is checked in `plait.daemon.deliveries`; a profile is merged by
`plait.daemon.profile_trace` and analysed by `plait.daemon.trace_analysis`. This module turns
protobuf into those records and back, maps refusals to status codes, and blocks the calling
thread while ranks answer (these calls count as long-lived in the call guard).
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from plait.daemon import trace_analysis
from plait.daemon.control import ControlRegistry
from plait.daemon.control_messages import (
    analysis_message,
    endpoint_message,
    hello_from,
    job_nodes_problem,
    order_message,
    outcome_message,
    poll_problem,
    replica_group_field,
    replica_group_of,
    stacks_message,
    world_report,
)
from plait.daemon.control_records import (
    DELIVERED,
    MEMORY,
    PROFILE,
    REJECTED,
    STACKS,
    Chunk,
    Outcome,
    ProfileSpec,
    RankDelivery,
    Refusal,
    Request,
    describe_outcomes,
    steps_for_seconds,
)
from plait.daemon.deliveries import (
    MEMORY_PART,
    STACKS_PART,
    TRACE_PART,
    BadDelivery,
    check_parts,
    read_memory,
    read_stacks,
    read_trace,
)
from plait.daemon.job_directory import JobDirectory
from plait.daemon.profile_trace import RankCapture, merge_captures
from plait.daemon.store import RankIdentity, SpanRecord, TelemetryStore
from plait.proto.plait.v1 import control_pb2, control_pb2_grpc

# A merged trace larger than this is refused rather than sent (the server's send limit).
MAX_TRACE_RESPONSE_BYTES = 240 * 2**20
REFUSAL_CODES = {
    "not_found": grpc.StatusCode.NOT_FOUND,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
}


# --------------------------------------------------------------------------------------------
# the service
# --------------------------------------------------------------------------------------------


class ControlService(control_pb2_grpc.ControlServicer):
    """Answers `plait.v1.Control` from the registry, the deliveries and the span store."""

    def __init__(
        self,
        registry: ControlRegistry,
        store: TelemetryStore,
        *,
        stopping: threading.Event,
        directory: JobDirectory | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.registry = registry
        self.directory = directory
        self.store = store
        self.stopping = stopping
        self.clock = clock
        self.limits = registry.limits
        self.bad_deliveries = 0
        self.bad_job_nodes = 0

    def _abort(self, context: grpc.ServicerContext, refusal: Refusal) -> None:
        context.abort(REFUSAL_CODES.get(refusal.code, grpc.StatusCode.UNKNOWN), str(refusal))

    def _deadline(self, timeout_seconds: float, default: float) -> int:
        seconds = timeout_seconds if timeout_seconds > 0 else default
        return self.clock() + int(min(seconds, self.limits.max_seconds * 4) * 1e9)

    # -- the ranks ------------------------------------------------------------------------------

    def Poll(
        self, request: control_pb2.PollRequest, context: grpc.ServicerContext
    ) -> control_pb2.PollResponse:
        problem = poll_problem(request)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"poll refused: {problem}")
        orders = self.registry.poll(hello_from(request), self.clock())
        return control_pb2.PollResponse(
            daemon_unix_nano=self.clock(),
            orders=[order_message(o) for o in orders],
            max_chunk_bytes=self.limits.max_chunk_bytes,
            wants_job_nodes=self._note_job_nodes(request),
        )

    def _note_job_nodes(self, request: control_pb2.PollRequest) -> bool:
        """Keep the job's node list a rank sent; whether this daemon still lacks one."""
        if self.directory is None:
            return False
        group = replica_group_of(request)
        if request.job_nodes:
            if job_nodes_problem(request):
                self.bad_job_nodes += 1  # the poll counts; the list is not kept
                return False
            self.directory.report(world_report(request, self.clock()))
            return False
        return not self.directory.knows(request.job_id, group)

    def Deliver(
        self, request: control_pb2.DeliverChunk, context: grpc.ServicerContext
    ) -> control_pb2.DeliverAck:
        if len(request.data) > self.limits.max_chunk_bytes:
            self.registry.rejected_chunks += 1
            return control_pb2.DeliverAck(
                accepted=False,
                reason=f"chunk of {len(request.data)} bytes is over {self.limits.max_chunk_bytes}",
            )
        chunk = Chunk(
            request_id=request.request_id,
            job_id=request.job_id,
            rank=request.rank,
            plan=request.plan,
            part=request.part,
            index=request.index,
            data=request.data,
            last=request.last,
            error=request.error,
            missed=request.missed,
            first_step=request.first_step,
            last_step=request.last_step,
            clock_offset_ns=request.clock_offset_nano,
            clock_rtt_ns=request.clock_rtt_nano,
            total_bytes=request.total_bytes,
            replica_group=replica_group_of(request),
        )
        accepted, reason = self.registry.deliver(chunk, self.clock())
        return control_pb2.DeliverAck(accepted=accepted, reason=reason)

    # -- operators ------------------------------------------------------------------------------

    def ListEndpoints(
        self, request: control_pb2.ListEndpointsRequest, context: grpc.ServicerContext
    ) -> control_pb2.ListEndpointsResponse:
        now = self.clock()
        return control_pb2.ListEndpointsResponse(
            endpoints=[endpoint_message(v) for v in self.registry.endpoints(request.job_id, now)],
            daemon_unix_nano=now,
        )

    def Clock(
        self, request: control_pb2.ClockRequest, context: grpc.ServicerContext
    ) -> control_pb2.ClockResponse:
        return control_pb2.ClockResponse(unix_nano=self.clock())

    def _open(
        self,
        context: grpc.ServicerContext,
        kind: str,
        job_id: str,
        ranks: Sequence[int],
        *,
        profile: ProfileSpec | None = None,
        step_wait_seconds: float = 0.0,
        replica_group: int | None = None,
    ) -> Request:
        try:
            return self.registry.open(
                kind,
                job_id,
                ranks,
                now_ns=self.clock(),
                known_jobs=self.store.job_ids(),
                profile=profile,
                step_wait_seconds=step_wait_seconds,
                replica_group=replica_group,
            )
        except Refusal as refusal:
            self._abort(context, refusal)
            raise

    def _profile_spec(
        self, request: control_pb2.ProfileRequest, context: grpc.ServicerContext
    ) -> ProfileSpec:
        limits = self.limits
        if (request.steps > 0) == (request.seconds > 0) or request.steps < 0 or request.seconds < 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "give steps (> 0) or seconds (> 0), not both"
            )
        if request.steps > limits.max_steps:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"steps: at most {limits.max_steps} per capture, got {request.steps}",
            )
        if request.seconds > limits.max_seconds:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"seconds: at most {limits.max_seconds:g} per capture, got {request.seconds:g}",
            )
        steps = request.steps
        if request.seconds:
            views = [
                v
                for v in self.registry.endpoints(
                    request.job_id, self.clock(), _group_filter(request)
                )
                if not request.ranks or v.hello.rank in request.ranks
            ]
            steps = steps_for_seconds(request.seconds, views)
            if steps > limits.max_steps:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"seconds: {request.seconds:g}s is {steps} steps at the job's pace; "
                    f"captures are limited to {limits.max_steps} steps",
                )
        return ProfileSpec(
            steps=steps,
            seconds=request.seconds,
            with_stack=request.with_stack,
            record_shapes=request.record_shapes,
        )

    def PrepareProfile(
        self, request: control_pb2.ProfileRequest, context: grpc.ServicerContext
    ) -> control_pb2.PrepareProfileResponse:
        spec = self._profile_spec(request, context)
        opened = self._open(
            context,
            PROFILE,
            request.job_id,
            request.ranks,
            profile=spec,
            replica_group=_group_filter(request),
        )
        deadline = self._deadline(request.timeout_seconds, self.limits.prepare_timeout_seconds)
        self.registry.wait(
            opened, lambda r: r.all_ready(), deadline_ns=deadline, clock=self.clock,
            stopping=self.stopping,
        )  # fmt: skip
        ready = [a for a, d in opened.deliveries.items() if d.state == "ready"]
        if not ready:
            outcomes = self.registry.close(opened, self.clock())
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "no rank made its profiler ready: " + describe_outcomes(outcomes),
            )
        self.registry.prepared(opened, self.clock())
        views = {v.hello.address: v for v in self.registry.endpoints(request.job_id, self.clock())}
        not_taking_part = list(opened.excluded) + [
            Outcome(opened.job_id, a.rank, d.host, d.state, d.detail, replica_group=a.replica_group)
            for a, d in opened.deliveries.items()
            if d.done
        ]
        return control_pb2.PrepareProfileResponse(
            request_id=opened.request_id,
            endpoints=[endpoint_message(views[a]) for a in sorted(ready) if a in views],
            outcomes=[outcome_message(o) for o in not_taking_part],
            steps=spec.steps,
            daemon_unix_nano=self.clock(),
        )

    def CollectProfile(
        self, request: control_pb2.CollectProfileRequest, context: grpc.ServicerContext
    ) -> control_pb2.ProfileResponse:
        opened = self.registry.get(request.request_id)
        if opened is None or opened.kind != PROFILE:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no prepared profile {request.request_id!r} (collected already, or expired)",
            )
        assert opened is not None
        start = request.start_step if request.HasField("start_step") else None
        if start is not None and start < 0:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"start_step: must be >= 0, got {start}"
            )
        start_step = self.registry.start_profile(opened, start, self.clock())
        deadline = self._deadline(request.timeout_seconds, self.limits.default_timeout_seconds)
        self.registry.wait(
            opened, lambda r: r.all_done(), deadline_ns=deadline, clock=self.clock,
            stopping=self.stopping,
        )  # fmt: skip
        outcomes = self.registry.close(opened, self.clock())
        captures, outcomes = self._captures(opened, outcomes)
        steps = opened.profile.steps if opened.profile else 0
        document = merge_captures(
            captures, request_id=opened.request_id, start_step=opened.start_step, steps=steps
        )
        analysis = trace_analysis.analyze(document)
        text = json.dumps(document, separators=(",", ":")).encode()
        packed = gzip.compress(text, compresslevel=6)
        if len(packed) > MAX_TRACE_RESPONSE_BYTES:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the merged trace is {len(packed) // 2**20} MiB compressed, over the "
                f"{MAX_TRACE_RESPONSE_BYTES // 2**20} MiB a reply may carry; capture fewer steps "
                "or ranks (--ranks)",
            )
        return control_pb2.ProfileResponse(
            request_id=opened.request_id,
            trace_json_gz=packed,
            trace_bytes=len(text),
            analysis=analysis_message(analysis),
            outcomes=[outcome_message(o) for o in outcomes],
            start_step=start_step if start_step >= 0 else opened.start_step,
            steps=steps,
        )

    def _captures(
        self, opened: Request, outcomes: list[Outcome]
    ) -> tuple[list[RankCapture], list[Outcome]]:
        """The delivered traces, read at the door; a bad one turns its rank's outcome into a
        rejection, the others are kept."""
        with self.store.lock:
            coordinates = {
                (w.identity.replica_group, w.identity.rank): dict(w.identity.coordinates)
                for w in self.store.windows(opened.job_id)
            }
        captures: list[RankCapture] = []
        checked: list[Outcome] = []
        for outcome in outcomes:
            delivery = opened.deliveries.get(outcome.address)
            if outcome.state != DELIVERED or delivery is None:
                checked.append(outcome)
                continue
            try:
                check_parts(PROFILE, delivery.parts)
                trace = read_trace(bytes(delivery.parts.get(TRACE_PART, b"")))
            except BadDelivery as exc:
                self.bad_deliveries += 1
                checked.append(_rejected(outcome, str(exc)))
                continue
            captures.append(
                RankCapture(
                    job_id=opened.job_id,
                    rank=outcome.rank,
                    host=outcome.host,
                    trace=trace,
                    coordinates=coordinates.get(outcome.address, {}),
                    clock_offset_ns=delivery.clock_offset_ns,
                    clock_rtt_ns=delivery.clock_rtt_ns,
                    first_step=delivery.first_step,
                    last_step=delivery.last_step,
                    spans=self._step_spans(opened.job_id, delivery),
                )
            )
            checked.append(outcome)
        return captures, checked

    def _step_spans(
        self, job_id: str, delivery: RankDelivery
    ) -> list[tuple[RankIdentity, SpanRecord]]:
        """plait's spans of the recorded steps (they reached the daemon before the trace: the
        rank flushes its exporter before it delivers), of the delivering rank's replica group."""
        first, last = delivery.first_step, delivery.last_step
        spans = self.store.spans_in(job_id=job_id, ranks=[delivery.rank], start_ns=0, end_ns=None)
        return [
            (identity, span)
            for identity, span in spans
            if identity.replica_group == delivery.replica_group
            and span.step is not None
            and first <= span.step <= last
            and span.kind != "expert_load"
        ]

    def Stacks(
        self, request: control_pb2.StacksRequest, context: grpc.ServicerContext
    ) -> control_pb2.StacksResponse:
        opened = self._open(
            context, STACKS, request.job_id, request.ranks, replica_group=_group_filter(request)
        )
        deadline = self._deadline(request.timeout_seconds, self.limits.stacks_timeout_seconds)
        self.registry.wait(
            opened, lambda r: r.all_done(), deadline_ns=deadline, clock=self.clock,
            stopping=self.stopping,
        )  # fmt: skip
        outcomes = self.registry.close(opened, self.clock())
        ranks, checked = [], []
        for outcome in outcomes:
            delivery = opened.deliveries.get(outcome.address)
            if outcome.state == DELIVERED and delivery is not None:
                try:
                    check_parts(STACKS, delivery.parts)
                    record = read_stacks(bytes(delivery.parts.get(STACKS_PART, b"")))
                except BadDelivery as exc:
                    self.bad_deliveries += 1
                    outcome = _rejected(outcome, str(exc))
                else:
                    ranks.append(
                        stacks_message(
                            opened.job_id,
                            outcome.rank,
                            outcome.host,
                            record,
                            replica_group=outcome.replica_group,
                        )
                    )
            checked.append(outcome)
        return control_pb2.StacksResponse(
            ranks=ranks, outcomes=[outcome_message(o) for o in checked]
        )

    def Memory(
        self, request: control_pb2.MemoryRequest, context: grpc.ServicerContext
    ) -> control_pb2.MemoryResponse:
        wait = request.step_wait_seconds or self.limits.memory_step_wait_seconds
        opened = self._open(
            context,
            MEMORY,
            request.job_id,
            request.ranks,
            step_wait_seconds=wait,
            replica_group=_group_filter(request),
        )
        deadline = self._deadline(
            request.timeout_seconds, wait + self.limits.stacks_timeout_seconds
        )
        self.registry.wait(
            opened, lambda r: r.all_done(), deadline_ns=deadline, clock=self.clock,
            stopping=self.stopping,
        )  # fmt: skip
        outcomes = self.registry.close(opened, self.clock())
        files, checked = [], []
        for outcome in outcomes:
            delivery = opened.deliveries.get(outcome.address)
            if outcome.state == DELIVERED and delivery is not None:
                try:
                    parts = read_memory(delivery.parts)
                except BadDelivery as exc:
                    self.bad_deliveries += 1
                    outcome = _rejected(outcome, str(exc))
                else:
                    files.extend(
                        control_pb2.RankFile(
                            rank=outcome.rank,
                            name=name,
                            data=data,
                            replica_group=replica_group_field(outcome.replica_group),
                        )
                        for name, data in sorted(parts.items(), key=lambda kv: kv[0] != MEMORY_PART)
                    )
            checked.append(outcome)
        return control_pb2.MemoryResponse(
            files=files, outcomes=[outcome_message(o) for o in checked]
        )


def _group_filter(
    request: control_pb2.ProfileRequest | control_pb2.StacksRequest | control_pb2.MemoryRequest,
) -> int | None:
    """The one replica group an operator's request addresses (None: every group)."""
    return request.replica_group if request.HasField("replica_group") else None


def _rejected(outcome: Outcome, reason: str) -> Outcome:
    return Outcome(
        outcome.job_id,
        outcome.rank,
        outcome.host,
        REJECTED,
        reason,
        outcome.last_poll_ns,
        replica_group=outcome.replica_group,
    )
