"""The two daemon calls the planner makes: recorded comm spans, and the measured breakdown.

`comm_samples(host)` captures the daemon's window of spans (`CaptureTrace`, the Chrome trace
`plait trace` writes) and turns every collective and point-to-point span into a `CommSample`
(op, bytes, group size, seconds, intra-node or not: whether every rank of its group reported
from one host). `measured_breakdowns(hosts)` is `GetBottleneck`'s per-rank step breakdown of
every host, the ranks of a world that another host's superseded left out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from plait.daemon import telemetry_schema as names
from plait.planner.comm_model import P2P_OPS, RING_OPS, CommSample

RPC_TIMEOUT_SECONDS = 30.0
_PROCESS_NAME = re.compile(r"rank (\d+) \((.*), job (.*)\)")


def _stub(host: str) -> tuple[Any, Any]:
    from plait.daemon.client_auth import DaemonClientAuth
    from plait.proto.plait.v1 import daemon_pb2_grpc

    channel = DaemonClientAuth.from_env().channel(host)
    return channel, daemon_pb2_grpc.DaemonStub(channel)


def capture_trace(host: str, *, job: str = "") -> dict[str, Any]:
    """The daemon's current window of spans as a Chrome trace document."""
    from plait.proto.plait.v1 import daemon_pb2

    channel, stub = _stub(host)
    try:
        request = daemon_pb2.CaptureTraceRequest(seconds=0, job_id=job)
        response = stub.CaptureTrace(request, timeout=RPC_TIMEOUT_SECONDS)
    finally:
        channel.close()
    return json.loads(response.chrome_trace_json or b'{"traceEvents": []}')


def samples_from_trace(documents: Iterable[Mapping[str, Any]]) -> list[CommSample]:
    """Comm spans of one or more captures as samples; spans of unknown ops are skipped."""
    events = [e for d in documents for e in d.get("traceEvents", [])]
    host_of: dict[int, str] = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            match = _PROCESS_NAME.match(str(event.get("args", {}).get("name", "")))
            if match:
                host_of[int(match.group(1))] = match.group(2)
    samples = []
    for event in events:
        if event.get("ph") != "X" or event.get("cat") != "comm":
            continue
        args = event.get("args", {})
        op = str(args.get(names.SPAN_COMM_OP, ""))
        if op not in RING_OPS and op not in P2P_OPS:
            continue
        ranks = [int(r) for r in args.get(names.SPAN_COMM_GROUP_RANKS) or []]
        peer = args.get(names.SPAN_COMM_PEER)
        if op in P2P_OPS and peer is not None:
            ranks = [int(event.get("pid", 0)), int(peer)]
        hosts = {host_of.get(r) for r in ranks}
        samples.append(
            CommSample(
                op=op,
                nbytes=float(args.get(names.SPAN_COMM_BYTES, 0)),
                group=max(len(ranks), 2 if op in P2P_OPS else 1),
                seconds=float(event.get("dur", 0.0)) / 1e6,
                intra_node=len(hosts) <= 1,
            )
        )
    return samples


def comm_samples(host: str, *, job: str = "") -> list[CommSample]:
    return samples_from_trace([capture_trace(host, job=job)])


def measured_breakdown(host: str, *, job: str = "", window_steps: int = 20) -> list[Any]:
    """`GetBottleneck`'s per-rank breakdowns (`metrics_pb2.BottleneckBreakdown`)."""
    return measured_breakdowns([host], job=job, window_steps=window_steps)


def measured_breakdowns(
    hosts: Sequence[str], *, job: str = "", window_steps: int = 20
) -> list[Any]:
    """The per-rank breakdowns of every host's daemon, less the ranks of a world that another
    host's superseded (an elastic shrink: `plait.daemon.worlds`)."""
    from plait.daemon.worlds import superseded_jobs, without_jobs
    from plait.proto.plait.v1 import daemon_pb2

    breakdowns, metrics = {}, {}
    for host in hosts:
        channel, stub = _stub(host)
        try:
            request = daemon_pb2.GetBottleneckRequest(job_id=job, window_steps=window_steps)
            breakdowns[host] = stub.GetBottleneck(request, timeout=RPC_TIMEOUT_SECONDS)
            worlds = daemon_pb2.GetMetricsRequest(job_id=job, window_steps=1)
            metrics[host] = stub.GetMetrics(worlds, timeout=RPC_TIMEOUT_SECONDS)
        finally:
            channel.close()
    superseded = superseded_jobs(metrics)
    return [r for host in hosts for r in without_jobs(breakdowns[host], superseded[host]).ranks]
