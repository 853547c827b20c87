"""The control channel addresses ranks by (job, replica group, rank): two replica groups of one
fault-tolerant job, each with its rank 0 on this node, are two endpoints. Their real clients
(`ControlClient`) poll a daemon on loopback; `plait stacks` reaches both and names each group,
`--replica-group` picks one, and an ordinary job's output carries no group at all.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from plait.core.step import JobInfo
from plait.daemon.control_records import ControlLimits
from plait.daemon.server import DaemonServer
from plait.plugins.telemetry.control_client import ControlClient
from plait.tools.cli import app

FT_JOB = "ft"
PLAIN_JOB = "plain"
WAIT = 30.0


def job_info(job_id: str, replica_group: int) -> JobInfo:
    return JobInfo(
        job_id=job_id, rank=0, local_rank=0, world_size=1, host="node-a", degrees={"dp": 1},
        coordinates={"dp": 0}, device="cpu", device_name="cpu", compute_dtype="float32",
        model_name="m", num_params=1, flops_per_token=1.0, tokens_per_step=1,
        replica_group=replica_group,
        memory_report=lambda: {"parameters": 4, "gradients": 0, "optimizer_state": 8, "total": 12},
    )  # fmt: skip


def wait_for(predicate, what: str, timeout: float = WAIT) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonServer]:
    with DaemonServer("127.0.0.1:0", host_interval=60.0, control=ControlLimits()) as server:
        yield server


@pytest.fixture(scope="module")
def ranks(daemon: DaemonServer) -> Iterator[list[ControlClient]]:
    """Rank 0 of replica groups 0 and 1 of one job, and rank 0 of an ordinary job, each
    polling from its own exporter-like thread."""
    channel = grpc.insecure_channel(daemon.address)
    identities = ((FT_JOB, 0), (FT_JOB, 1), (PLAIN_JOB, -1))
    clients = [
        ControlClient(
            channel=channel, info=job_info(job, group), flush_spans=lambda t: True, interval=0.05
        )
        for job, group in identities
    ]
    stop = threading.Event()

    def export(client: ControlClient) -> None:
        while not stop.wait(0.02):
            client.tick()

    threads = [threading.Thread(target=export, args=(c,), daemon=True) for c in clients]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(daemon.control.endpoints(FT_JOB, time.time_ns())) == 2,
             "both replica groups' rank 0 to register")  # fmt: skip
    wait_for(lambda: bool(daemon.control.endpoints(PLAIN_JOB, time.time_ns())),
             "the ordinary job's rank to register")  # fmt: skip
    yield clients
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    for client in clients:
        client.close()
    channel.close()


def cli(daemon: DaemonServer, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, [*args, "--host", daemon.address])
    return result.exit_code, result.output


def test_stacks_reach_both_groups_rank_0_and_name_their_group(
    daemon: DaemonServer, ranks: list[ControlClient]
) -> None:
    code, output = cli(daemon, "stacks", "--job", FT_JOB, "--json")
    answer = json.loads(output)
    assert code == 0, output
    assert [(r["replica_group"], r["rank"]) for r in answer["ranks"]] == [(0, 0), (1, 0)]
    assert all(r["threads"] for r in answer["ranks"])
    assert [(o["replica_group"], o["state"]) for o in answer["outcomes"]] == [
        (0, "delivered"), (1, "delivered")
    ]  # fmt: skip
    code, text = cli(daemon, "stacks", "--job", FT_JOB)
    assert code == 0 and "group 0 rank 0 · node-a" in text and "group 1 rank 0 · node-a" in text


def test_one_replica_group_is_picked_and_an_unknown_one_is_named(
    daemon: DaemonServer, ranks: list[ControlClient]
) -> None:
    code, output = cli(daemon, "stacks", "--job", FT_JOB, "--replica-group", "1", "--json")
    answer = json.loads(output)
    assert code == 0, output
    assert [(r["replica_group"], r["rank"]) for r in answer["ranks"]] == [(1, 0)]
    code, output = cli(daemon, "stacks", "--job", FT_JOB, "--replica-group", "7", "--json")
    (error,) = json.loads(output)["errors"]
    assert code == 1 and "no replica group 7" in error["error"] and "groups: 0, 1" in error["error"]


def test_memory_files_of_two_groups_rank_0_do_not_overwrite_each_other(
    daemon: DaemonServer, ranks: list[ControlClient], tmp_path: Path
) -> None:
    code, output = cli(daemon, "memory", "--job", FT_JOB, "-o", str(tmp_path), "--wait", "0.1",
                       "--json")  # fmt: skip
    answer = json.loads(output)
    assert code == 0, output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "group0.rank0.memory.json", "group1.rank0.memory.json"
    ]  # fmt: skip
    assert [(r["replica_group"], r["rank"]) for r in answer["ranks"]] == [(0, 0), (1, 0)]


def test_a_profile_of_a_fault_tolerant_job_takes_one_group(
    daemon: DaemonServer, ranks: list[ControlClient], tmp_path: Path
) -> None:
    code, output = cli(daemon, "profile", "--job", FT_JOB, "--steps", "1", "-o",
                       str(tmp_path / "t.json"), "--json")  # fmt: skip
    (error,) = json.loads(output)["errors"]
    assert code == 1 and "one replica group at a time" in error["error"], output


def test_an_ordinary_job_carries_no_group(daemon: DaemonServer, ranks: list[ControlClient]) -> None:
    code, output = cli(daemon, "stacks", "--job", PLAIN_JOB, "--json")
    answer = json.loads(output)
    assert code == 0, output
    (stacks,) = answer["ranks"]
    assert "replica_group" not in stacks and stacks["rank"] == 0
    assert all("replica_group" not in o for o in answer["outcomes"])
    code, text = cli(daemon, "stacks", "--job", PLAIN_JOB)
    headers = [line for line in text.splitlines() if "· node-a ·" in line]
    assert code == 0 and [h.split(" · ")[0] for h in headers] == ["rank 0"], text
    code, output = cli(daemon, "stacks", "--job", PLAIN_JOB, "--replica-group", "0", "--json")
    (error,) = json.loads(output)["errors"]
    assert code == 1 and "no replica groups" in error["error"]
