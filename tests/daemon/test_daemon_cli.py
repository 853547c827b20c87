"""`plait status`, `plait top --once` and `plait trace` against daemons on loopback."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, metrics_pb2
from plait.tools import daemon_commands
from plait.tools.daemon_commands import aggregate_jobs, app
from tests.daemon.daemon_fakes import FakeBackend, run_fake_rank

runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon_commands, "console", Console(width=220))


@pytest.fixture
def two_daemons():
    """One 2-rank job whose ranks report to two daemons, as on two nodes."""
    with (
        DaemonServer("127.0.0.1:0", host_interval=0.2) as a,
        DaemonServer("127.0.0.1:0", host_interval=0.2) as b,
    ):
        run_fake_rank(a.address, rank=0, steps=3, backend=FakeBackend())
        run_fake_rank(b.address, rank=1, steps=3, backend=FakeBackend())
        yield a, b


def test_status_lists_ranks_of_every_host(two_daemons) -> None:
    a, b = two_daemons
    result = runner.invoke(app, ["status", "--host", a.address, "--host", b.address])
    assert result.exit_code == 0, result.output
    assert a.address in result.output and b.address in result.output
    assert "cpu-calibration" in result.output
    assert result.output.count("job-a") >= 2


def test_top_once_aggregates_hosts(two_daemons) -> None:
    a, b = two_daemons
    result = runner.invoke(app, ["top", "--once", "--host", a.address, "--host", b.address])
    assert result.exit_code == 0, result.output
    assert "2/2" in result.output  # both ranks of the job, seen through two daemons


def test_job_aggregation_adds_achieved_and_peak() -> None:
    def response(flops: float, peak: float, step_seconds: float) -> daemon_pb2.GetMetricsResponse:
        job = metrics_pb2.JobMetrics(
            job_id="j", world_size=4, ranks_reporting=2, step=9, model_flops_per_second=flops,
            peak_flops=peak, step_seconds=step_seconds, tokens_per_second=100.0,
        )  # fmt: skip
        return daemon_pb2.GetMetricsResponse(jobs=[job])

    (job,) = aggregate_jobs([response(3e12, 10e12, 1.0), response(1e12, 10e12, 1.5)])
    assert job.mfu == pytest.approx(4e12 / 20e12)
    assert (job.ranks_reporting, job.step_seconds, job.tokens_per_second) == (4, 1.5, 200.0)


def test_trace_merges_hosts_into_one_file(two_daemons, tmp_path) -> None:
    a, b = two_daemons
    output = tmp_path / "trace.json"
    args = ["trace", "--seconds", "0", "-o", str(output), "--host", a.address, "--host", b.address]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    events = json.loads(output.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert sum(e["cat"] == "comm" for e in events if e["ph"] == "X") == 2 * 3 * 3


def test_unreachable_host_is_reported_and_fails(daemon_server) -> None:
    result = runner.invoke(
        app, ["status", "--host", daemon_server.address, "--host", "127.0.0.1:9"]
    )
    assert result.exit_code == 1
    assert "UNAVAILABLE" in result.output
