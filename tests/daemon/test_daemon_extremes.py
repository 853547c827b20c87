"""Property: the extremes of every numeric attribute break nothing, here or upstream.

Every numeric attribute of the schema (resource, span, metric point and span times) is sent with
each edge value of its type — int64 min and max, ±0, NaN, ±inf, the largest doubles, 2**63 as a
double — as raw OTLP to a node daemon that forwards to an upstream daemon. After each batch,
on the node, on the upstream daemon and on both at once: every plait.v1 RPC answers,
`/metrics` scrapes, every CLI view (`status`, `top`, `bottleneck`, `trace`; tables and `--json`,
`--all` too) exits 0 with strict JSON, and a healthy job's figures do not move.

A deterministic sweep sends every (attribute, value) pair once; hypothesis then mixes several
extremes into one item.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    Gauge,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from rich.console import Console
from typer.testing import CliRunner

from plait.daemon import telemetry_schema as schema
from plait.daemon.server import DaemonServer
from plait.tools import daemon_commands
from tests.daemon.otlp_inputs import (
    Probe,
    key_values,
    probe,
    rank_resource,
    step_spans,
    trace_request,
)

GOOD = "good"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT_EXTREMES = (INT64_MIN, -1, 0, 2**31 - 1, 2**31, INT64_MAX - 1, INT64_MAX)
FLOAT_EXTREMES = (
    0.0, -0.0, math.nan, math.inf, -math.inf, 1.7976931348623157e308, -1.7976931348623157e308,
    2.0**63, 1e300, 5e-324,
)  # fmt: skip
EXTREMES: tuple[int | float, ...] = INT_EXTREMES + FLOAT_EXTREMES

# Where each numeric attribute goes: "resource", a span kind, or "point" (heartbeat attributes).
RESOURCE_NUMBERS = (
    schema.RESOURCE_RANK, schema.RESOURCE_LOCAL_RANK, schema.RESOURCE_WORLD_SIZE,
    schema.RESOURCE_RESTART_ATTEMPT, schema.RESOURCE_PEAK_FLOPS, schema.RESOURCE_NUM_PARAMS,
    schema.RESOURCE_FLOPS_PER_TOKEN, schema.RESOURCE_TOKENS_PER_STEP, schema.RESOURCE_PROCESS_PID,
    schema.RESOURCE_MESH_COORD_PREFIX + "dp", schema.RESOURCE_MESH_DEGREE_PREFIX + "dp",
    schema.RESOURCE_REPLICA_GROUP,
)  # fmt: skip
SPAN_NUMBERS: dict[str, tuple[str, ...]] = {
    "step": (schema.SPAN_STEP, schema.SPAN_STEP_TOKENS, schema.SPAN_STEP_MODEL_FLOPS,
             schema.SPAN_STEP_DATA_WAIT, schema.SPAN_STEP_LOSS, schema.SPAN_STEP_LR,
             schema.SPAN_STEP_GRAD_NORM),
    "phase": (schema.SPAN_STEP, schema.SPAN_MICROBATCH, schema.SPAN_CHUNK),
    "comm": (schema.SPAN_STEP, schema.SPAN_COMM_BYTES, schema.SPAN_COMM_SEQ,
             schema.SPAN_COMM_PEER, schema.SPAN_COMM_GROUP_RANKS,
             schema.SPAN_COMM_BYTES_INTRA_NODE, schema.SPAN_COMM_BYTES_INTER_NODE),
    "expert_load": (schema.SPAN_STEP, schema.SPAN_MOE_TOKENS_PER_EXPERT, schema.SPAN_MOE_DROPPED),
    "quorum": (schema.SPAN_STEP, schema.SPAN_QUORUM_ID, schema.SPAN_QUORUM_PARTICIPANTS,
               schema.SPAN_QUORUM_PREVIOUS),
    "job_end": (schema.SPAN_STEP,),
    "checkpoint": (schema.SPAN_CHECKPOINT_STEP, schema.SPAN_CHECKPOINT_BLOCKED,
                   schema.SPAN_CHECKPOINT_WRITE, schema.SPAN_CHECKPOINT_BYTES),
}  # fmt: skip
SPAN_TIMES = ("start", "end")  # the span's own start and end (fixed64 on the wire)
POINT_NUMBERS = (schema.SPAN_COMM_SEQ, schema.SPAN_COMM_GROUP_RANKS)
LISTS = {schema.SPAN_COMM_GROUP_RANKS, schema.SPAN_MOE_TOKENS_PER_EXPERT}
# Constants of the schema that name no number (strings, booleans, prefixes, span names, units).
NOT_NUMBERS = {
    "RESOURCE_JOB_ID", "RESOURCE_DEVICE", "RESOURCE_DEVICE_NAME", "RESOURCE_COMPUTE_DTYPE",
    "RESOURCE_PEAK_FLOPS_SOURCE", "RESOURCE_MODEL_NAME", "RESOURCE_HOST_NAME",
    "RESOURCE_MESH_COORD_PREFIX", "RESOURCE_MESH_DEGREE_PREFIX", "SPAN_STEP_SKIPPED",
    "SPAN_PHASE", "SPAN_COMM_OP", "SPAN_COMM_DTYPE", "SPAN_COMM_GROUP", "SPAN_COMM_PURPOSE",
    "SPAN_COMM_ASYNC", "SPAN_COMM_ALGORITHM", "SPAN_PHASE_ATTRIBUTE_PREFIX", "SPAN_JOB_OUTCOME",
    "SPAN_MOE_LAYER", "SPAN_QUORUM_EVENT", "SPAN_QUORUM_DETAIL", "SPAN_REPLICA_ID",
    "SPAN_CHECKPOINT_ASYNC", "SPAN_CHECKPOINT_OUTCOME", "SPAN_CHECKPOINT_ERROR",
}  # fmt: skip


def test_every_numeric_attribute_of_the_schema_is_covered() -> None:
    """A number added to the schema must be added here (or named as no number)."""
    covered = set(RESOURCE_NUMBERS) | {a for names in SPAN_NUMBERS.values() for a in names}
    for constant in dir(schema):
        if not constant.startswith(("RESOURCE_", "SPAN_")) or constant.startswith("SPAN_KIND"):
            continue
        value = getattr(schema, constant)
        if constant in NOT_NUMBERS:
            continue
        assert value in covered or any(value in c for c in covered), constant


# --------------------------------------------------------------------------------------------
# raw OTLP items
# --------------------------------------------------------------------------------------------


Poison = tuple[str, str, Any]  # (where: "resource", a span kind, "time", "point"; name; value)


def _spans(base_ns: int, step: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """A valid span of each kind for one step: name and attributes."""
    return {
        "step": (schema.STEP_SPAN_NAME, {
            schema.SPAN_STEP: step, schema.SPAN_STEP_TOKENS: 256,
            schema.SPAN_STEP_MODEL_FLOPS: 1e9, schema.SPAN_STEP_DATA_WAIT: 0.001,
            schema.SPAN_STEP_LOSS: 2.5, schema.SPAN_STEP_LR: 1e-3,
            schema.SPAN_STEP_GRAD_NORM: 1.0}),
        "phase": (schema.PHASE_FORWARD, {
            schema.SPAN_STEP: step, schema.SPAN_PHASE: schema.PHASE_FORWARD,
            schema.SPAN_MICROBATCH: 0, schema.SPAN_CHUNK: 0}),
        "comm": ("all_reduce", {
            schema.SPAN_STEP: step, schema.SPAN_COMM_OP: "all_reduce",
            schema.SPAN_COMM_BYTES: 4096, schema.SPAN_COMM_GROUP: "dp",
            schema.SPAN_COMM_GROUP_RANKS: [0, 1], schema.SPAN_COMM_SEQ: step,
            schema.SPAN_COMM_PEER: 1, schema.SPAN_COMM_PURPOSE: "grad_bucket"}),
        "expert_load": (schema.EXPERT_LOAD_SPAN_NAME, {
            schema.SPAN_STEP: step, schema.SPAN_MOE_LAYER: "layers.0.moe",
            schema.SPAN_MOE_TOKENS_PER_EXPERT: [10, 30], schema.SPAN_MOE_DROPPED: 1}),
        "quorum": (schema.QUORUM_EVENT_SPAN_NAME, {
            schema.SPAN_STEP: step, schema.SPAN_QUORUM_EVENT: schema.QUORUM_EVENT_JOIN,
            schema.SPAN_QUORUM_ID: step, schema.SPAN_QUORUM_PARTICIPANTS: 2,
            schema.SPAN_QUORUM_PREVIOUS: 1, schema.SPAN_QUORUM_DETAIL: "",
            schema.SPAN_REPLICA_ID: "job-group0:1"}),
        "checkpoint": (schema.CHECKPOINT_SAVE_SPAN_NAME, {
            schema.SPAN_CHECKPOINT_STEP: step + 1, schema.SPAN_CHECKPOINT_ASYNC: True,
            schema.SPAN_CHECKPOINT_OUTCOME: schema.CHECKPOINT_SAVED,
            schema.SPAN_CHECKPOINT_BLOCKED: 0.01, schema.SPAN_CHECKPOINT_WRITE: 0.05,
            schema.SPAN_CHECKPOINT_BYTES: 4096}),
    }  # fmt: skip


def poisoned_requests(
    job: str, poisons: list[Poison], base_ns: int
) -> tuple[
    trace_service_pb2.ExportTraceServiceRequest, metrics_service_pb2.ExportMetricsServiceRequest
]:
    """One rank of `job` (world 2) with three steps of every span kind, a job end and heartbeat
    points; each poison replaces its attribute in the last step's items (or the resource)."""
    resource: dict[str, Any] = {
        **rank_resource(job, 0),
        schema.RESOURCE_MESH_COORD_PREFIX + "dp": 0,
        schema.RESOURCE_MESH_DEGREE_PREFIX + "dp": 2,
        schema.RESOURCE_FLOPS_PER_TOKEN: 1e6,
    }
    spans = []
    last = 2
    for step in range(last + 1):
        start = base_ns + step * 10**8
        for kind, (name, attributes) in _spans(base_ns, step).items():
            if kind == "checkpoint" and step != last:
                continue  # one save per job, after its last step
            times = {"start": start, "end": start + 5 * 10**7}
            if step == last:
                for where, key, value in poisons:
                    if where == kind:
                        attributes[key] = [1, value] if key in LISTS else value
                    elif where == "time" and kind == "step":
                        times[key] = value
            spans.append(
                Span(
                    name=name,
                    start_time_unix_nano=min(max(int(times["start"]), 0), 2**64 - 1),
                    end_time_unix_nano=min(max(int(times["end"]), 0), 2**64 - 1),
                    attributes=key_values(attributes),
                )
            )
    end = {schema.SPAN_STEP: last, schema.SPAN_JOB_OUTCOME: schema.JOB_OUTCOME_FINISHED}
    end.update({k: v for where, k, v in poisons if where == "job_end"})
    spans.append(
        Span(
            name=schema.JOB_END_SPAN_NAME,
            start_time_unix_nano=base_ns + 4 * 10**8,
            end_time_unix_nano=base_ns + 4 * 10**8,
            attributes=key_values(end),
        )
    )
    for where, key, value in poisons:
        if where == "resource":
            resource[key] = value
    traces = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])]
    )
    traces.resource_spans[0].resource.attributes.extend(key_values(resource))

    point_attributes: dict[str, Any] = {
        schema.SPAN_COMM_GROUP: "dp", schema.SPAN_COMM_GROUP_RANKS: [0, 1],
        schema.SPAN_COMM_OP: "all_reduce", schema.SPAN_COMM_SEQ: 3,
    }  # fmt: skip
    for where, key, value in poisons:
        if where == "point":
            point_attributes[key] = [1, value] if key in LISTS else value
    metric_values = {name: 1.0 for name in schema.METRIC_UNITS} | {
        schema.METRIC_TRAIN_LOSS: 2.5,
        schema.METRIC_COMM_HEARTBEAT: base_ns / 1e9,
        schema.METRIC_COMM_INFLIGHT: base_ns / 1e9,
    }
    for where, key, value in poisons:
        if where == "metric":
            metric_values[key] = float(value)
    now = time.time_ns()
    metrics = [
        Metric(
            name=name,
            gauge=Gauge(
                data_points=[
                    NumberDataPoint(
                        time_unix_nano=now,
                        as_double=value,
                        attributes=key_values(point_attributes),
                    )
                ]
            ),
        )
        for name, value in metric_values.items()
    ]
    points = metrics_service_pb2.ExportMetricsServiceRequest(
        resource_metrics=[ResourceMetrics(scope_metrics=[ScopeMetrics(metrics=metrics)])]
    )
    points.resource_metrics[0].resource.attributes.extend(key_values(resource))
    return traces, points


METRIC_NAMES = (*schema.METRIC_UNITS, schema.METRIC_TRAIN_LOSS)


def every_poison() -> list[Poison]:
    """Every numeric attribute with every extreme of its encoding (ints as int and double)."""
    out: list[Poison] = []
    for value in EXTREMES:
        out += [("resource", name, value) for name in RESOURCE_NUMBERS]
        out += [(kind, n, value) for kind, names in SPAN_NUMBERS.items() for n in names]
        out += [("point", name, value) for name in POINT_NUMBERS]
        out += [("metric", name, value) for name in METRIC_NAMES]
    for value in INT_EXTREMES:
        out += [("time", which, value) for which in SPAN_TIMES]
    out += [("time", which, 2**64 - 1) for which in SPAN_TIMES]
    return out


# --------------------------------------------------------------------------------------------
# the daemons and what is checked on them
# --------------------------------------------------------------------------------------------


@dataclass
class Nodes:
    node: DaemonServer  # what the ranks export to
    upstream: DaemonServer  # what the node forwards to
    good_before: dict[str, Any]
    sent: int = 0


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} in --json output: not JSON")

    return json.loads(text, parse_constant=refuse)


CLI_VIEWS: tuple[tuple[str, ...], ...] = (
    ("status",), ("status", "--json"), ("status", "--json", "--all"),
    ("top", "--once"), ("top", "--json"), ("top", "--json", "--all"),
    ("bottleneck",), ("bottleneck", "--json"), ("bottleneck", "--json", "--all"),
)  # fmt: skip


def check_cli(hosts: list[str], trace_file: Path) -> None:
    runner = CliRunner()
    targets = [a for host in hosts for a in ("--host", host)]
    for view in CLI_VIEWS:
        result = runner.invoke(daemon_commands.app, [*view, *targets])
        assert result.exit_code == 0, (view, hosts, result.output, result.exception)
        if "--json" in view:
            _strict_json(result.output)
        else:
            assert result.output.strip()
    result = runner.invoke(
        daemon_commands.app, ["trace", "--seconds", "0", "-o", str(trace_file), *targets]
    )
    assert result.exit_code == 0, (hosts, result.output, result.exception)
    _strict_json(trace_file.read_text())


def _forwarded_all(nodes: Nodes) -> None:
    """Wait until the upstream daemon received what the node forwarded (the forwarder's own
    count of requests sent, against the requests the node accepted anything from)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        forwarder = probe_status(nodes.node).forwarder
        assert forwarder.dropped_requests == 0, forwarder
        if forwarder.queued_requests == 0 and forwarder.forwarded_requests >= nodes.sent:
            return
        time.sleep(0.05)
    raise AssertionError(f"the node forwarded {forwarder.forwarded_requests} of {nodes.sent}")


def probe_status(server: DaemonServer) -> Any:
    from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        return daemon_pb2_grpc.DaemonStub(channel).Status(daemon_pb2.StatusRequest(), timeout=10)


def check_everything(nodes: Nodes, folder: Path) -> None:
    _forwarded_all(nodes)
    for name, server in (("node", nodes.node), ("upstream", nodes.upstream)):
        answers: Probe = probe(server)
        assert answers.prometheus_status == 200
        assert answers.figures(GOOD) == nodes.good_before[name], name
        check_cli([server.address], folder / f"{name}.json")
    check_cli([nodes.node.address, nodes.upstream.address], folder / "both.json")


def send(nodes: Nodes, job: str, poisons: list[Poison]) -> None:
    base_ns = time.time_ns() - 10**9
    spans, points = poisoned_requests(job, poisons, base_ns)
    with grpc.insecure_channel(nodes.node.address) as channel:
        traces = trace_service_pb2_grpc.TraceServiceStub(channel)
        metrics = metrics_service_pb2_grpc.MetricsServiceStub(channel)
        for request, stub in ((spans, traces), (points, metrics)):
            response = stub.Export(request, timeout=10)
            total = (
                sum(len(ss.spans) for rs in spans.resource_spans for ss in rs.scope_spans)
                if request is spans
                else len(points.resource_metrics[0].scope_metrics[0].metrics)
            )
            rejected = (
                response.partial_success.rejected_spans
                if request is spans
                else response.partial_success.rejected_data_points
            )
            if rejected < total:
                nodes.sent += 1  # something was accepted: the node forwards that request


@contextlib.contextmanager
def node_and_upstream() -> Iterator[Nodes]:
    """A node daemon forwarding to an upstream one, a healthy 2-rank job reported to both."""
    # Ranks never go stale here: the healthy job's figures must not move while the test runs.
    quiet = {"stale_floor": 3600.0, "stale_ceiling": 3600.0}
    upstream = DaemonServer(
        "127.0.0.1:0", host_interval=0.5, prometheus="127.0.0.1:0", **quiet
    ).start()
    node = DaemonServer(
        "127.0.0.1:0",
        host_interval=0.5,
        prometheus="127.0.0.1:0",
        otlp_endpoint=f"http://{upstream.address}",
        **quiet,
    ).start()
    try:
        state = Nodes(node, upstream, {})
        with grpc.insecure_channel(node.address) as channel:
            traces = trace_service_pb2_grpc.TraceServiceStub(channel)
            base_ns = time.time_ns() - 10**9
            for rank in (0, 1):
                request = trace_request(rank_resource(GOOD, rank), step_spans(0, 5, base_ns))
                assert not traces.Export(request, timeout=5).HasField("partial_success")
                state.sent += 1
        _forwarded_all(state)
        state.good_before = {
            "node": probe(node).figures(GOOD),
            "upstream": probe(upstream).figures(GOOD),
        }
        yield state
    finally:
        node.stop(grace=0.5)
        upstream.stop(grace=0.5)


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon_commands, "console", Console(width=200))


@pytest.mark.timeout(600)
def test_every_extreme_of_every_number_alone(tmp_path: Path) -> None:
    with node_and_upstream() as nodes:
        for index, poison in enumerate(every_poison()):
            send(nodes, f"sweep-{index}", [poison])
        check_everything(nodes, tmp_path)
        status, upstream = probe_status(nodes.node), probe_status(nodes.upstream)
    # The door did turn items away (and said why), and the rest reached the upstream daemon.
    assert status.spans_rejected > 0 and status.metric_points_rejected > 0
    assert f"{schema.SPAN_STEP}: out of range" in status.rejected_by_reason
    assert upstream.spans_rejected == 0 and upstream.metric_points_rejected == 0
    assert upstream.ranks > 0


poison_items = st.one_of(
    st.tuples(st.just("resource"), st.sampled_from(RESOURCE_NUMBERS), st.sampled_from(EXTREMES)),
    st.sampled_from(sorted(SPAN_NUMBERS)).flatmap(
        lambda kind: st.tuples(
            st.just(kind), st.sampled_from(SPAN_NUMBERS[kind]), st.sampled_from(EXTREMES)
        )
    ),
    st.tuples(st.just("point"), st.sampled_from(POINT_NUMBERS), st.sampled_from(EXTREMES)),
    st.tuples(st.just("metric"), st.sampled_from(METRIC_NAMES), st.sampled_from(EXTREMES)),
)


@pytest.mark.timeout(600)
def test_several_extremes_at_once(tmp_path: Path) -> None:
    examples = iter(range(10**6))

    @settings(
        max_examples=10,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(st.lists(poison_items, min_size=2, max_size=6))
    def send_then_check(poisons: list[Poison]) -> None:
        send(nodes, f"mixed-{next(examples)}", poisons)
        check_everything(nodes, tmp_path)

    # One pair of daemons for every example (starting one costs more than an example), apart
    # from the sweep's: its hundreds of jobs would slow every view down.
    with node_and_upstream() as nodes:
        send_then_check()


def test_the_shown_step_never_leaves_int64() -> None:
    """Analysis holds the bound whatever reached the store (the door keeps wire steps below
    `MAX_WIRE_STEP`, so the step after the last is still an int64)."""
    from plait.daemon.analysis import shown_step
    from plait.daemon.decoder import MAX_WIRE_STEP

    assert MAX_WIRE_STEP + 1 == INT64_MAX
    assert shown_step(None) == 0 and shown_step(0) == 1
    assert shown_step(MAX_WIRE_STEP) == INT64_MAX == shown_step(INT64_MAX)


def test_the_door_keeps_room_for_the_shown_step() -> None:
    from plait.daemon.decoder import MAX_WIRE_STEP, Rejected, decode_span

    attributes = {schema.SPAN_STEP: MAX_WIRE_STEP, schema.SPAN_STEP_MODEL_FLOPS: 1.0}
    assert decode_span("step", 0, 1, attributes).step == MAX_WIRE_STEP
    with pytest.raises(Rejected, match=r"plait.step: 9223372036854775807 is outside \[0, 9223"):
        decode_span("step", 0, 1, {**attributes, schema.SPAN_STEP: INT64_MAX})


def test_every_rpc_and_cli_view_is_exercised() -> None:
    """An RPC or a daemon command added later must be added to the probe or `CLI_VIEWS`."""
    from plait.proto.plait.v1 import daemon_pb2

    service = daemon_pb2.DESCRIPTOR.services_by_name["Daemon"]
    probed = {"Status", "ListRanks", "GetMetrics", "StreamMetrics", "GetBottleneck", "CaptureTrace",
              "ListJobDaemons", "AskJob"}  # fmt: skip
    assert {m.name for m in service.methods} == probed  # what `otlp_inputs.probe` calls
    commands = {c.name or c.callback.__name__ for c in daemon_commands.app.registered_commands} - {
        "daemon"
    }
    assert commands == {view[0] for view in CLI_VIEWS} | {"trace"}
