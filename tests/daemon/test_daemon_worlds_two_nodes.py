"""Two nodes, a daemon each, and an elastic shrink: every view agrees on the newest world.

Rank 0 reports to daemon A and rank 1 to daemon B (the documented one-daemon-per-node set-up),
each a process running plait's telemetry plugin (`world_producers.produce`). Killing rank 1 plays
the lost node; killing rank 0 and starting it again as world 1, attempt 1, plays torchrun's
restart of the survivor. Daemon B never hears of world 1: it keeps "world 2, rank 1 stale". The
CLI across both hosts (`top`, `status`, `bottleneck`, tables and `--json`) and the planner's
measured breakdown must read 1/1 ranks, nothing stale, worlds 2 → 1, and rank 1 superseded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from rich.console import Console
from typer.testing import CliRunner

from plait.daemon.config import DaemonConfig
from plait.daemon.server import DaemonServer
from plait.planner.daemon_client import measured_breakdowns
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from plait.tools import daemon_commands
from tests.daemon.test_daemon_worlds import FAST, FOREVER, SLOW, STALE_FLOOR, job, rank, wait_for
from tests.daemon.test_daemon_worlds import spawn as spawn  # the fixture, used by name

JOB = "elastic2"


@pytest.fixture
def daemons() -> Iterator[tuple[DaemonServer, DaemonServer]]:
    config = DaemonConfig(bind="127.0.0.1:0", host_interval=0.5, stale_floor=STALE_FLOOR)
    with DaemonServer(config=config) as node_a, DaemonServer(config=config) as node_b:
        yield node_a, node_b


def cli(*args: str) -> str:
    result = CliRunner().invoke(daemon_commands.app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.timeout(240)
def test_an_elastic_shrink_reads_the_same_on_both_daemons(
    daemons: tuple[DaemonServer, DaemonServer],
    spawn: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(daemon_commands, "console", Console(width=200))
    node_a, node_b = daemons
    hosts = ["--host", node_a.address, "--host", node_b.address]
    with grpc.insecure_channel(node_a.address) as a, grpc.insecure_channel(node_b.address) as b:
        stub_a, stub_b = daemon_pb2_grpc.DaemonStub(a), daemon_pb2_grpc.DaemonStub(b)
        survivor = spawn(node_a.address, JOB, 0, 2, 0, 0, FOREVER, FAST)
        lost = spawn(node_b.address, JOB, 1, 2, 0, 0, FOREVER, SLOW)

        def reporting(r: daemon_pb2.GetMetricsResponse) -> bool:
            j = job(r, JOB)
            return bool(j) and j.ranks_reporting == 1 and j.window_steps >= 3

        wait_for(stub_a, reporting, timeout=90)
        wait_for(stub_b, reporting, timeout=90)
        # One world seen from two daemons: its ranks add up.
        (before,) = json.loads(cli("top", "--json", *hosts))["jobs"]
        assert (before["ranks_reporting"], before["world_size"]) == (2, 2)

        lost.kill()  # node B is gone: no end of run, no more exports
        lost.join(timeout=10)
        survivor.kill()  # torchrun stops the survivor's worker and forms world 1
        survivor.join(timeout=10)
        spawn(node_a.address, JOB, 0, 1, 1, 40, FOREVER, FAST)

        def restarted(r: daemon_pb2.GetMetricsResponse) -> bool:
            j = job(r, JOB)
            return bool(j) and j.world_size == 1 and j.window_steps >= 3

        wait_for(stub_a, restarted, timeout=90)

        def stale(r: daemon_pb2.GetMetricsResponse) -> bool:
            dead = rank(r, JOB, 1)
            return bool(dead) and dead.status == "stale"

        # Daemon B alone still believes in world 2, its rank 1 stale (as the issue saw it).
        left_behind, _ = wait_for(stub_b, stale, timeout=STALE_FLOOR + 30)
        j = job(left_behind, JOB)
        assert (j.world_size, j.ranks_stale, list(j.world_sizes)) == (2, 1, [2])

    top = json.loads(cli("top", "--json", *hosts))
    (merged,) = top["jobs"]
    assert merged["ranks_reporting"] == 1 and merged["world_size"] == 1
    assert merged["world"]["ranks_stale"] == 0 and merged["world"]["state"] == "running"
    assert merged["world"]["world_sizes"] == [2, 1] and merged["world"]["restarts"] == 1
    assert merged["world"]["started_step"] == 41
    assert [(r["rank"], r["status"]) for r in top["ranks"]] == [(0, "live")]
    everything = json.loads(cli("top", "--json", "--all", *hosts))
    assert sorted((r["rank"], r["status"]) for r in everything["ranks"]) == [
        (0, "live"),
        (1, "superseded"),
    ]

    table = cli("top", "--once", *hosts)
    (row,) = [line for line in table.splitlines() if f"│ {JOB}" in line][:1]
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    assert cells[:7] == [JOB, "1/1", "running", "2 → 1", "1", "41", "-"], table
    assert "stale" not in [c.strip() for line in table.splitlines() for c in line.split("│")]

    status = json.loads(cli("status", "--json", *hosts))
    (merged,) = status["jobs"]
    assert (merged["ranks_reporting"], merged["world_size"]) == (1, 1)
    assert merged["world"]["ranks_stale"] == 0
    assert [(r["rank"], r["world_size"]) for r in status["ranks"]] == [(0, 1)]
    listed = json.loads(cli("status", "--json", "--all", *hosts))["ranks"]
    assert sorted((r["rank"], r["world_size"], r["status"]) for r in listed) == [
        (0, 1, "live"),
        (1, 2, "superseded"),
    ]

    breakdown = json.loads(cli("bottleneck", "--json", "--all", *hosts))
    assert [(r["job_id"], r["rank"]) for r in breakdown["ranks"]] == [(JOB, 0)]
    assert [r.rank for r in measured_breakdowns([node_a.address, node_b.address], job=JOB)] == [0]
