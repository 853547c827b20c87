"""Output written to a file reads as a log: no field wrapped over two lines, no column lost.

The commands run as a user's would under Slurm or Kubernetes: a `plait` process whose stdout
is a file and whose environment sets no `COLUMNS`. Every table row must be one line holding
every column's header in full; long lines (the demo's) must stay one line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from plait.daemon import telemetry_schema as schema
from plait.daemon.server import DaemonServer
from plait.tools.daemon_jobs import world_columns
from plait.tools.daemon_views import job_columns, rank_metric_columns
from plait.training.output import LOG_WIDTH, heading, make_console
from tests.daemon.otlp_inputs import rank_resource, step_spans, trace_request

PLAIT = [sys.executable, "-m", "plait.tools.cli"]
JOB = "a-job-with-a-long-name-2026-11-26"


def run_to_file(args: list[str], folder: Path, timeout: float = 120) -> str:
    """`plait ARGS` with stdout and stderr in a file, no COLUMNS: what a log receives."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    log = folder / "out.log"
    with log.open("w") as out:
        code = subprocess.run(
            [*PLAIT, *args], stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout
        ).returncode
    text = log.read_text()
    assert code == 0, text
    return text


def tables(text: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Each rich table in `text` by title: its header cells and its body rows' cells, one row
    per line (a wrapped header or cell shows as a second header line or row)."""
    lines = text.splitlines()
    found: dict[str, tuple[list[str], list[list[str]]]] = {}
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("┏"):
            continue
        title = lines[i - 1].strip()
        headers = []
        j = i + 1
        while lines[j].lstrip().startswith("┃"):
            headers.append([c.strip() for c in lines[j].strip().strip("┃").split("┃")])
            j += 1
        assert len(headers) == 1, f"table {title!r}: the header wraps:\n" + "\n".join(lines[i:j])
        assert lines[j].lstrip().startswith("┡")
        rows = []
        j += 1
        while lines[j].lstrip().startswith("│"):
            rows.append([c.strip() for c in lines[j].strip().strip("│").split("│")])
            j += 1
        found[title] = (headers[0], rows)
    return found


def test_the_console_of_a_log_never_wraps(tmp_path: Path) -> None:
    line = "daemon │ " + " | ".join(
        f"rank {r}: step 120 · 12,061 tok/s · MFU 31.5%" for r in range(8)
    )
    with (tmp_path / "log").open("w") as file:
        console = make_console(file=file)
        assert console.width == LOG_WIDTH
        console.print(line, style="cyan", highlight=False)
        heading(console, "what the daemon saw")
    written = (tmp_path / "log").read_text().splitlines()
    assert written[0] == line
    assert written[1].startswith("── what the daemon saw ──") and len(written[1]) == 100
    # COLUMNS, when set, is obeyed: a log asked to be 80 wide is.
    with (tmp_path / "log80").open("w") as file:
        os.environ["COLUMNS"] = "80"
        try:
            assert make_console(file=file).width == 80
        finally:
            del os.environ["COLUMNS"]


@pytest.mark.timeout(120)
def test_plait_plugins_in_a_file_is_one_line_per_plugin(tmp_path: Path) -> None:
    listing = json.loads(run_to_file(["plugins", "--json"], tmp_path))
    (header, rows) = tables(run_to_file(["plugins"], tmp_path))["plait plugins"]
    assert header == ["plugin", "distribution", "hooks", "provides"]
    assert [row[0] for row in rows] == [plugin["name"] for plugin in listing]
    for row, plugin in zip(rows, listing, strict=True):
        hooks = ", ".join(h.removeprefix("plait_") for h in plugin["hooks"])
        assert row[2] == hooks, row


@pytest.fixture(scope="module")
def daemon() -> Iterator[str]:
    """A daemon with a 2-rank job of a long name whose throughput needs a thousands separator."""
    server = DaemonServer("127.0.0.1:0", host_interval=0.2).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            traces = trace_service_pb2_grpc.TraceServiceStub(channel)
            base_ns = time.time_ns() - 2 * 10**9
            for rank in (0, 1):
                spans = step_spans(0, 8, base_ns, **{schema.SPAN_STEP_TOKENS: 2_412_200})
                traces.Export(trace_request(rank_resource(JOB, rank), spans), timeout=5)
        yield server.address
    finally:
        server.stop(grace=0.5)


@pytest.mark.timeout(120)
def test_top_status_and_bottleneck_in_a_file_keep_every_column(daemon: str, tmp_path: Path) -> None:
    top = tables(run_to_file(["top", "--once", "--host", daemon], tmp_path))
    header, rows = top["jobs"]
    every_job_column = [c.header for c in job_columns({})]
    # The world columns show only for a job that restarted (and the rest have no such job).
    shown = [h for h in every_job_column if h not in {c.header for c in world_columns()}]
    assert [h for h in header if h in every_job_column] == [
        h for h in every_job_column if h in header
    ]
    assert set(shown) - {"stale"} <= set(header), header
    assert "tokens/s" in header and len(rows) == 1
    job_row = dict(zip(header, rows[0], strict=True))
    assert job_row["job"] == JOB  # not shortened: a log has the room
    assert re.fullmatch(r"\d{1,3}(,\d{3})+", job_row["tokens/s"]), job_row
    rank_header, rank_rows = top["ranks"]
    assert {"host", "job", "rank", "tokens/s", "MFU", "step ms"} <= set(rank_header)
    assert sorted(r[rank_header.index("rank")] for r in rank_rows) == ["0", "1"]
    assert all(r[rank_header.index("job")] == JOB for r in rank_rows)
    every_rank_column = [c.header for c in rank_metric_columns({}, [], LOG_WIDTH)]
    assert set(rank_header) == set(every_rank_column) - {"status"} or set(rank_header) == set(
        every_rank_column
    )

    status = tables(run_to_file(["status", "--host", daemon], tmp_path))
    daemon_header, (daemon_row,) = status["daemons"]
    assert {"host", "version", "uptime s", "jobs", "ranks", "metric points"} <= set(daemon_header)
    assert dict(zip(daemon_header, daemon_row, strict=True))["jobs"] == JOB
    ranks_header, ranks = status["ranks"]
    assert {"device name", "peak from", "pid", "silent s"} <= set(ranks_header)
    assert len(ranks) == 2

    bottleneck = tables(run_to_file(["bottleneck", "--host", daemon], tmp_path))
    header, rows = bottleneck["bottleneck (mean ms per step)"]
    assert {"job", "rank", "steps", "step ms", "compute", "dominant"} <= set(header)
    assert len(rows) == 2 and all(r[0] == JOB for r in rows)
