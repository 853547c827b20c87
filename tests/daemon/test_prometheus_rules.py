"""A real Prometheus scraping two daemons of one job, with `plait prometheus-rules` loaded:
the job's tokens/s and MFU it records equal what `plait top --json --job J` prints across both
daemons, and the straggler score names the slow rank. The scrape targets are the file
`plait prometheus-targets` writes. Skipped where Debian's `prometheus` is not installed (`make`
installs it where apt and root allow).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from typer.testing import CliRunner

from plait.daemon.config import DaemonConfig
from plait.daemon.server import DaemonServer
from plait.tools import daemon_commands, prometheus_commands
from tests.daemon.otlp_inputs import STEP_NS, rank_resource, step_spans, trace_request
from tests.daemon.test_job_questions import HOST, nodes_of, poll
from tests.free_ports import unassigned_port

PROMETHEUS = shutil.which("prometheus")
JOB = "fleet"
WAIT = 90.0

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus is not installed")


def _feed(daemon: DaemonServer, rank: int, slow: float = 1.0) -> None:
    """10 steps of `rank` (of 4), each `slow` times the usual step time."""
    spans = [
        replace(span, end_ns=span.start_ns + int(STEP_NS * slow)) if span.name == "step" else span
        for span in step_spans(0, 10, time.time_ns() - 2 * 10**9)
    ]
    request = trace_request(rank_resource(JOB, rank, 4, **{"host.name": HOST}), spans)
    with grpc.insecure_channel(daemon.address) as channel:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=10)


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())["data"]["result"]


@pytest.mark.timeout(180)
def test_recorded_job_figures_equal_what_top_prints(tmp_path: Path) -> None:
    config = DaemonConfig(
        bind="127.0.0.1:0", prometheus="127.0.0.1:0", host_interval=3600.0, stale_floor=3600.0,
        stale_ceiling=3600.0,
    )  # fmt: skip
    with DaemonServer(config=config) as a, DaemonServer(config=config) as b:
        for rank, daemon, slow in ((0, a, 1.0), (1, a, 1.0), (2, b, 1.0), (3, b, 1.5)):
            _feed(daemon, rank, slow)
        nodes = nodes_of(a.address, b.address)
        poll(a, 0, nodes, 0)
        poll(b, 1, nodes, 1)
        env = {"PLAIT_DAEMON": a.address}
        targets = tmp_path / "targets" / "fleet.json"
        made = CliRunner().invoke(
            prometheus_commands.app, ["prometheus-targets", "--job", JOB, "-o", str(targets)],
            env=env,
        )  # fmt: skip
        assert made.exit_code == 0, made.output
        rules = tmp_path / "rules.yml"
        made = CliRunner().invoke(
            prometheus_commands.app, ["prometheus-rules", "--interval", "1", "-o", str(rules)]
        )
        assert made.exit_code == 0, made.output
        (tmp_path / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: [{rules}]\n"
            "scrape_configs:\n"
            "  - job_name: plait\n"
            "    file_sd_configs:\n"
            f"      - {{files: ['{tmp_path}/targets/*.json'], refresh_interval: 1s}}\n"
        )
        port = unassigned_port()
        log = (tmp_path / "prometheus.log").open("w")
        server = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            recorded: dict[str, list[dict]] = {}
            names = ("plait:job_tokens_per_second", "plait:job_mfu:ratio",
                     "plait:rank_straggler_score:ratio")  # fmt: skip
            deadline = time.monotonic() + WAIT
            while True:
                assert server.poll() is None, (tmp_path / "prometheus.log").read_text()
                try:
                    recorded = {name: _query(port, name) for name in names}
                except OSError:
                    recorded = {}
                if recorded and all(recorded.values()) and len(recorded[names[2]]) == 4:
                    break
                assert time.monotonic() < deadline, (recorded, log.name)
                time.sleep(0.5)
        finally:
            server.terminate()
            server.wait(timeout=30)
        top = CliRunner().invoke(daemon_commands.app, ["top", "--json", "--job", JOB], env=env)
        assert top.exit_code == 0, top.output
        document = json.loads(top.stdout)
        (job,) = document["jobs"]
        assert job["ranks_reporting"] == 4
        (tokens,) = recorded["plait:job_tokens_per_second"]
        (mfu,) = recorded["plait:job_mfu:ratio"]
        assert float(tokens["value"][1]) == pytest.approx(job["tokens_per_second"], rel=1e-9)
        assert float(mfu["value"][1]) == pytest.approx(job["mfu"], rel=1e-9)
        # Each rank's step time over the median of all ranks of both daemons, minus one.
        steps = sorted(r["step_seconds"] for r in document["ranks"])
        median = (steps[1] + steps[2]) / 2
        scores = {
            int(s["metric"]["plait_rank"]): float(s["value"][1])
            for s in recorded["plait:rank_straggler_score:ratio"]
        }
        for rank in document["ranks"]:
            assert scores[rank["rank"]] == pytest.approx(rank["step_seconds"] / median - 1)
        assert max(scores, key=scores.__getitem__) == 3
