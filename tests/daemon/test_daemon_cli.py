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
        # Mid-run (no end-of-run span): a finished job would be hidden without --all.
        run_fake_rank(a.address, rank=0, steps=3, backend=FakeBackend(), finish=False)
        run_fake_rank(b.address, rank=1, steps=3, backend=FakeBackend(), finish=False)
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
    # The job ended (finished jobs are listed when named).
    args = ["top", "--once", "--job", "job-a", "--host", a.address, "--host", b.address]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "2/2" in result.output  # both ranks of the job, seen through two daemons


def parse(result) -> dict:
    assert result.output.lstrip().startswith("{"), result.output  # nothing but the document
    return json.loads(result.output)


def test_json_outputs_parse_and_carry_the_figures(two_daemons) -> None:
    a, b = two_daemons
    hosts = ["--host", a.address, "--host", b.address]
    status = parse(runner.invoke(app, ["status", "--json", *hosts]))
    assert (status["command"], status["schema_version"]) == ("status", 1)
    assert [d["host"] for d in status["daemons"]] == [a.address, b.address]
    assert all(d["error"] is None and d["status"]["ranks"] == 1 for d in status["daemons"])
    ranks = sorted(status["ranks"], key=lambda r: r["rank"])
    assert [(r["job_id"], r["rank"], r["device"]) for r in ranks] == [
        ("job-a", 0, "cpu"),
        ("job-a", 1, "cpu"),
    ]
    assert isinstance(ranks[0]["spans_received"], int)  # not protobuf's string for int64
    for command in (["top", "--once", "--json"], ["top", "--json"]):
        top = parse(runner.invoke(app, [*command, "--job", "job-a", *hosts]))
        (job,) = top["jobs"]
        assert (job["job_id"], job["ranks_reporting"], job["world_size"]) == ("job-a", 2, 2)
        assert job["tokens_per_second"] == pytest.approx(
            sum(r["tokens_per_second"] for r in top["ranks"])
        )
        assert [h["address"] for h in top["hosts"]] == [a.address, b.address]
    verdict = parse(runner.invoke(app, ["bottleneck", "--json", "--job", "job-a", *hosts]))
    assert {r["rank"] for r in verdict["ranks"]} == {0, 1}
    assert all(r["comm_ops_by_purpose"]["grad_bucket"] == "all_reduce" for r in verdict["ranks"])
    (job_verdict,) = verdict["jobs"]
    assert job_verdict["job_id"] == "job-a" and job_verdict["dominant"] == "compute"
    # Advised for the ranks' device (CPU, from ListRanks): no Triton, no bf16.
    text = job_verdict["advice"]
    assert "more cores per rank" in text and "Triton" not in text and "bf16" not in text
    assert verdict["errors"] == [] and verdict["png"] is None


def test_json_names_an_unreachable_host_and_fails(daemon_server) -> None:
    hosts = ["--host", daemon_server.address, "--host", "127.0.0.1:9"]
    for command in (["status"], ["top", "--once"], ["bottleneck"]):
        result = runner.invoke(app, [*command, "--json", *hosts])
        assert result.exit_code == 1
        document = parse(result)
        text = json.dumps(document)
        assert "127.0.0.1:9" in text and "UNAVAILABLE" in text, command


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
    assert "spans from ranks [0, 1] to" in result.output


def test_unreachable_host_is_reported_and_fails(daemon_server) -> None:
    result = runner.invoke(
        app, ["status", "--host", daemon_server.address, "--host", "127.0.0.1:9"]
    )
    assert result.exit_code == 1
    assert "UNAVAILABLE" in result.output
