"""`plait.v1.Control` messages to and from the control channel's records.

Plain functions, one per message, used by the servicer (`plait.daemon.control_service`) and by
the CLI (which plans a start step over several daemons' endpoints and renders analyses).

A rank's replica group travels as an optional field: unset means an ordinary job
(`NO_REPLICA_GROUP` in the records), so an ordinary job's messages are as they always were.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from plait.daemon import trace_analysis
from plait.daemon.control_records import (
    CANCEL,
    DELIVERED,
    MAX_STEP,
    MEMORY,
    PROFILE,
    STACKS,
    EndpointView,
    Order,
    Outcome,
    ProfileSpec,
    RankHello,
    rank_label,
)
from plait.daemon.deliveries import RankStacksRecord
from plait.daemon.job_directory import JobNode, WorldReport
from plait.daemon.telemetry_schema import NO_REPLICA_GROUP
from plait.proto.plait.v1 import control_pb2

# --------------------------------------------------------------------------------------------


class _WithReplicaGroup(Protocol):
    def HasField(self, field_name: str) -> bool: ...

    @property
    def replica_group(self) -> int: ...


def replica_group_of(message: _WithReplicaGroup) -> int:
    """The replica group a message carries (`NO_REPLICA_GROUP` when unset)."""
    return message.replica_group if message.HasField("replica_group") else NO_REPLICA_GROUP


def replica_group_field(replica_group: int) -> int | None:
    """The value for a message's optional `replica_group` (None, left unset: an ordinary job)."""
    return None if replica_group == NO_REPLICA_GROUP else replica_group


def job_nodes_problem(request: control_pb2.PollRequest) -> str:
    """Why a poll's node list cannot be kept ("" if it can); the poll itself still counts."""
    nodes = request.job_nodes
    if len(nodes) > request.world_size:
        return f"job_nodes: {len(nodes)} nodes for a world of {request.world_size}"
    indices = sorted(n.node for n in nodes)
    if indices != list(range(len(nodes))):
        return f"job_nodes: node indices {indices[:8]} are not 0..{len(nodes) - 1}"
    if request.self_node not in indices:
        return f"self_node: {request.self_node} is none of the {len(nodes)} nodes"
    for node in nodes:
        _, sep, port = node.daemon.rpartition(":")
        if not sep or not port.isdigit():
            return f"job_nodes[{node.node}].daemon: {node.daemon!r} is not HOST:PORT"
        if any(not 0 <= r < request.world_size for r in node.ranks):
            return f"job_nodes[{node.node}].ranks: outside [0, {request.world_size})"
    return ""


def world_report(request: control_pb2.PollRequest, now_ns: int) -> WorldReport:
    """The job's node list a rank sent with its poll."""
    return WorldReport(
        job_id=request.job_id,
        replica_group=replica_group_of(request),
        nodes=tuple(
            sorted(
                (JobNode(n.node, n.host, n.daemon, tuple(n.ranks)) for n in request.job_nodes),
                key=lambda n: n.node,
            )
        ),
        here=request.self_node,
        reported_unix_nano=now_ns,
    )


def hello_from(request: control_pb2.PollRequest) -> RankHello:
    return RankHello(
        job_id=request.job_id,
        rank=request.rank,
        world_size=request.world_size,
        host=request.host,
        pid=request.pid,
        device=request.device,
        coordinates=dict(request.coordinates),
        step=request.step,
        clock_offset_ns=request.clock_offset_nano,
        clock_rtt_ns=request.clock_rtt_nano,
        busy=tuple(request.busy),
        ready=tuple(request.ready),
        leaving=request.leaving,
        replica_group=replica_group_of(request),
    )


def poll_problem(request: control_pb2.PollRequest) -> str:
    """Why a poll cannot be taken ("" if it can): the identity must make sense."""
    if not request.job_id:
        return "job_id: empty"
    if request.world_size < 1:
        return f"world_size: must be >= 1, got {request.world_size}"
    if not 0 <= request.rank < request.world_size:
        return f"rank: must be in [0, {request.world_size}), got {request.rank}"
    if not -1 <= request.step <= MAX_STEP:
        return f"step: must be in [-1, {MAX_STEP}], got {request.step}"
    if request.clock_rtt_nano < 0:
        return f"clock_rtt_nano: must be >= 0, got {request.clock_rtt_nano}"
    if request.HasField("replica_group") and request.replica_group < 0:
        return f"replica_group: must be >= 0 (or unset), got {request.replica_group}"
    return ""


def order_message(order: Order) -> control_pb2.RankOrder:
    message = control_pb2.RankOrder(request_id=order.request_id)
    if order.kind == PROFILE:
        spec = order.profile or ProfileSpec()
        message.profile.CopyFrom(
            control_pb2.ProfileOrder(
                plan=order.plan,
                start_step=order.start_step,
                steps=spec.steps,
                seconds=spec.seconds,
                with_stack=spec.with_stack,
                record_shapes=spec.record_shapes,
                max_bytes=order.max_bytes,
            )
        )
    elif order.kind == STACKS:
        message.stacks.CopyFrom(control_pb2.StacksOrder())
    elif order.kind == MEMORY:
        message.memory.CopyFrom(
            control_pb2.MemoryOrder(
                max_bytes=order.max_bytes, step_wait_seconds=order.step_wait_seconds
            )
        )
    elif order.kind == CANCEL:
        message.cancel.CopyFrom(control_pb2.CancelOrder(reason=order.reason))
    return message


def endpoint_message(view: EndpointView) -> control_pb2.ControlEndpoint:
    hello = view.hello
    return control_pb2.ControlEndpoint(
        job_id=hello.job_id,
        rank=hello.rank,
        world_size=hello.world_size,
        host=hello.host,
        pid=hello.pid,
        device=hello.device,
        coordinates=hello.coordinates,
        step=hello.step,
        steps_per_second=view.steps_per_second,
        last_poll_unix_nano=view.last_poll_ns,
        polling=view.polling,
        clock_offset_nano=hello.clock_offset_ns,
        clock_rtt_nano=hello.clock_rtt_ns,
        left=view.left,
        replica_group=replica_group_field(hello.replica_group),
    )


def endpoint_view(message: control_pb2.ControlEndpoint) -> EndpointView:
    """An endpoint reported by a daemon, as the planning functions take it (the CLI's side)."""
    return EndpointView(
        hello=RankHello(
            job_id=message.job_id,
            rank=message.rank,
            world_size=message.world_size,
            host=message.host,
            step=message.step,
            replica_group=replica_group_of(message),
        ),
        last_poll_ns=message.last_poll_unix_nano,
        steps_per_second=message.steps_per_second,
        polling=message.polling,
        left=message.left,
    )


def outcome_message(outcome: Outcome) -> control_pb2.RankOutcome:
    return control_pb2.RankOutcome(
        job_id=outcome.job_id,
        rank=outcome.rank,
        host=outcome.host,
        state=outcome.state,
        detail=outcome.detail,
        last_poll_unix_nano=outcome.last_poll_ns,
        replica_group=replica_group_field(outcome.replica_group),
    )


def analysis_message(analysis: trace_analysis.TraceAnalysis) -> control_pb2.TraceAnalysis:
    summary = analysis.summary
    return control_pb2.TraceAnalysis(
        ranks=[
            control_pb2.RankTraceFigures(
                job_id=r.job_id,
                rank=r.rank,
                host=r.host,
                timeline=r.timeline,
                steps=r.steps,
                window_seconds=r.window_seconds,
                compute_seconds=r.compute_seconds,
                communication_seconds=r.communication_seconds,
                memory_seconds=r.memory_seconds,
                idle_seconds=r.idle_seconds,
                idle_host_seconds=r.idle_host_seconds,
                idle_peer_wait_seconds=r.idle_peer_wait_seconds,
                communication_total_seconds=r.communication_total_seconds,
                overlap_fraction=r.overlap_fraction,
                launches=r.launches,
                launch_cpu_seconds=r.launch_cpu_seconds,
                launch_delay_mean_seconds=r.launch_delay_mean_seconds,
                launch_delay_max_seconds=r.launch_delay_max_seconds,
                short_kernels=r.short_kernels,
                top_ops=[
                    control_pb2.TopOp(name=o.name, kind=o.kind, count=o.count, seconds=o.seconds)
                    for o in r.top_ops
                ],
            )
            for r in analysis.ranks
        ],
        summary=control_pb2.CrossRankSummary(
            slowest_rank=summary.slowest_rank,
            slowest_class=summary.slowest_class,
            excess_seconds=summary.excess_seconds,
            others_wait_seconds=summary.others_wait_seconds,
            verdict=summary.verdict,
        ),
    )


def stacks_message(
    job_id: str,
    rank: int,
    host: str,
    record: RankStacksRecord,
    replica_group: int = NO_REPLICA_GROUP,
) -> control_pb2.RankStacks:
    return control_pb2.RankStacks(
        job_id=job_id,
        rank=rank,
        replica_group=replica_group_field(replica_group),
        host=host,
        pid=record.pid,
        step=record.step,
        taken_unix_nano=record.taken_ns,
        in_flight=record.in_flight,
        threads=[
            control_pb2.ThreadStack(
                thread_id=t.thread_id,
                name=t.name,
                training=t.training,
                daemon=t.daemon,
                frames=[
                    control_pb2.StackFrame(
                        file=f.file, line=f.line, function=f.function, code=f.code
                    )
                    for f in t.frames
                ],
            )
            for t in record.threads
        ],
    )


def outcomes_text(outcomes: Iterable[control_pb2.RankOutcome]) -> str:
    """The ranks that did not deliver, one clause each (empty when all did)."""
    return "; ".join(
        f"{rank_label(replica_group_of(o), o.rank)} {o.state}"
        + (f" ({o.detail})" if o.detail else "")
        for o in outcomes
        if o.state != DELIVERED
    )
