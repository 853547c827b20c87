"""`plait bottleneck` across hosts (table, stragglers, --png), hangs in `plait status`, and
`plait daemon` refusing an unprotected public bind."""

from __future__ import annotations

import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from rich.console import Console
from typer.testing import CliRunner

from plait.daemon import telemetry_schema as names
from plait.daemon.hangs import Heartbeat, InflightOp
from plait.daemon.server import DaemonServer
from plait.tools import daemon_commands
from plait.tools.daemon_commands import app

runner = CliRunner()
MS = 1_000_000


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon_commands, "console", Console(width=240))


def send_steps(address: str, rank: int, forward_ms: int, steps: int = 3) -> None:
    """100 ms steps of one rank of job "cli": data 10 ms, forward, backward 20 ms, optimizer."""
    resource = Resource.create(
        {names.RESOURCE_JOB_ID: "cli", names.RESOURCE_RANK: rank, names.RESOURCE_WORLD_SIZE: 2}
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=address, insecure=True, timeout=5))
    )
    tracer = provider.get_tracer("test")
    base = time.time_ns()
    for step in range(steps):
        start = base + step * 100 * MS
        backward_end = 30 + forward_ms
        phases = (
            ("data", 0, 10),
            ("forward", 10, 10 + forward_ms),
            ("backward", 10 + forward_ms, backward_end),
            ("optimizer", 90, 95),
        )
        for name, begin, end in phases:
            attributes = {names.SPAN_STEP: step, names.SPAN_PHASE: name}
            span = tracer.start_span(name, start_time=start + begin * MS, attributes=attributes)
            span.end(end_time=start + end * MS)
        attributes = {names.SPAN_STEP: step, names.SPAN_STEP_MODEL_FLOPS: 1e9}
        tracer.start_span("step", start_time=start, attributes=attributes).end(
            end_time=start + 100 * MS
        )
    provider.shutdown()


def test_bottleneck_aggregates_hosts_and_flags_the_slow_rank(tmp_path) -> None:
    with (
        DaemonServer("127.0.0.1:0", host_interval=0.2) as a,
        DaemonServer("127.0.0.1:0", host_interval=0.2) as b,
    ):
        send_steps(a.address, rank=0, forward_ms=20)
        send_steps(b.address, rank=1, forward_ms=50)  # on the other node, 30 ms slower
        png = tmp_path / "bottleneck.png"
        result = runner.invoke(
            app, ["bottleneck", "--host", a.address, "--host", b.address, "--png", str(png)]
        )
    assert result.exit_code == 0, result.output
    rows = [
        [cell.strip() for cell in line.split("│")[1:-1]]
        for line in result.output.splitlines()
        if line.startswith("│ cli")
    ]
    breakdown = [row for row in rows if len(row) == 11]
    # rank 0: compute 20 + 20 ms, 45 ms of gaps; rank 1: compute 50 + 20 ms. No rank spends
    # time in communication or a bubble: "-".
    assert breakdown[0][1:] == ["0", "3", "100.0", "40.0", "-", "10.0", "-", "5.0", "45.0",
                                "host/other"]  # fmt: skip
    assert breakdown[1][4] == "70.0" and breakdown[1][-1] == "compute"
    # Scored against both hosts' ranks: rank 1 computes 27% above the median.
    stragglers = [row for row in rows if len(row) == 8]
    assert [row[1] for row in stragglers if row[-1] == "STRAGGLER"] == ["1"]
    assert "job cli — compute:" in result.output  # one verdict for the job over both hosts
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_status_shows_hangs_and_daemon_refuses_public_bind() -> None:
    with DaemonServer("127.0.0.1:0", host_interval=0.2, hang_timeout=1.0) as server:
        now = time.time_ns()
        group = ("tp", (0, 1))
        resource = {
            names.RESOURCE_JOB_ID: "cli", names.RESOURCE_RANK: 0, names.RESOURCE_WORLD_SIZE: 2
        }  # fmt: skip
        stuck = InflightOp("tp", (0, 1), "all_gather", 41, "tp_activation", now - 3 * 10**9)
        server.store.set_heartbeat(resource, Heartbeat(now, (stuck,), {group: 41}))
        server.store.set_heartbeat(
            {**resource, names.RESOURCE_RANK: 1}, Heartbeat(now, (), {group: 40})
        )
        result = runner.invoke(app, ["status", "--host", server.address])
    assert result.exit_code == 0, result.output
    assert "collective hangs" in result.output
    (row,) = [line for line in result.output.splitlines() if "all_gather" in line]
    assert "41" in row and "tp [0, 1]" in row
    refused = runner.invoke(app, ["daemon", "--bind", "0.0.0.0:0"])
    assert refused.exit_code == 2 and "--insecure" in refused.output
