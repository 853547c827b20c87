"""A fault-tolerant job's replica groups in the daemon, fed real OTLP by the ranks' own exporter.

Two replica groups of one job, two ranks each (each group its own world, ranks 0 and 1), export
through plait's `SpanExporter` with the resource `telemetry_resource` builds, into a real
`DaemonServer` that hosts torchft's lighthouse. The groups' rank 0s send their quorum events the
way the trainer does (`publish_quorum_events` on `plait.core.span_board.BOARD`, taken by the
telemetry plugin's hook).
Group 1 then falls silent (a lost group): it leaves the job's MFU, the lighthouse still shows its
last heartbeat ageing, and `plait status --json` lists join, leave, failed commit, then the
rejoin and heal in the order they happened.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from rich.console import Console
from typer.testing import CliRunner

from plait.core.step import StepReport
from plait.daemon import telemetry_schema as schema
from plait.daemon.config import DaemonConfig
from plait.daemon.lighthouse import LighthouseSettings
from plait.daemon.peak_flops import PeakFlops
from plait.daemon.server import DaemonServer
from plait.daemon.service import daemon_points
from plait.daemon.telemetry_resource import resource_attributes
from plait.plugins.fault_tolerance.quorum_events import PublishedQuorumEvent, QuorumEvent
from plait.plugins.telemetry.exporter import SpanExporter
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from plait.tools import daemon_commands
from tests.daemon.daemon_fakes import job_info

pytest.importorskip("torchft")

JOB = "ftjob"
FLOPS = 1.0e9  # per step, each group's whole world
PEAK = 1.0e12  # per rank
STEP_SECONDS = {0: 0.1, 1: 0.2}  # group 1's steps take twice as long
REPLICA_IDS = {0: f"{JOB}-group0:aaaa", 1: f"{JOB}-group1:bbbb"}
STALE_FLOOR = 1.0
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


@pytest.fixture
def server() -> Iterator[DaemonServer]:
    config = DaemonConfig(
        bind="127.0.0.1:0",
        host_interval=0.5,
        stale_floor=STALE_FLOOR,
        stale_step_multiple=1.0,
        lighthouse=LighthouseSettings(bind="127.0.0.1:0", min_replicas=2),
    )
    with DaemonServer(config=config) as daemon:
        yield daemon


class Group:
    """One replica group's two ranks, each with the rank side's own span exporter."""

    def __init__(self, channel: grpc.Channel, index: int) -> None:
        export = channel.unary_unary(
            EXPORT,
            request_serializer=lambda request: request,
            response_deserializer=ExportTraceServiceResponse.FromString,
        )
        self.index = index
        self.exporters = [
            SpanExporter(
                send=lambda request: export(request, timeout=10),
                resource=resource_attributes(
                    job_info(rank=rank, world_size=2, job_id=JOB, replica_group=index),
                    PeakFlops(PEAK, "test"),
                ),
                scope=("plait", "test"),
                batch_delay=3600.0,  # sent when the test flushes
            )
            for rank in (0, 1)
        ]
        self.step = 0

    def steps(self, count: int) -> None:
        """`count` steps of STEP_SECONDS each, ending now, on both ranks."""
        seconds = STEP_SECONDS[self.index]
        end = time.time_ns()
        for n in range(count):
            start = end - int((count - n) * seconds * 1e9)
            report = StepReport(
                step=self.step,
                loss=2.0,
                tokens=512,
                step_seconds=seconds,
                data_wait_seconds=0.0,
                model_flops=FLOPS,
                lr=1e-3,
                start_ns=start,
                end_ns=start + int(seconds * 1e9),
            )
            for exporter in self.exporters:
                exporter.put_step(report)
            self.step += 1
        self.flush()

    def event(self, kind: str, quorum_id: int, previous: int, participants: int, **more) -> None:
        """Rank 0 sends one quorum event, as the trainer publishes it."""
        now = time.time_ns()
        event = QuorumEvent(
            kind=kind,  # type: ignore[arg-type]
            step=self.step,
            quorum_id=quorum_id,
            participants=participants,
            previous=previous,
            start_ns=now - 50_000_000,
            end_ns=now,
            **more,
        )
        published = PublishedQuorumEvent(event, REPLICA_IDS[self.index])
        self.exporters[0].put_published(published, event.step)
        self.flush()

    def flush(self) -> None:
        for exporter in self.exporters:
            assert exporter.flush(10.0)

    def close(self) -> None:
        for exporter in self.exporters:
            exporter.shutdown(10.0)


def docs_json_example() -> str:
    """The `plait status --json` example of docs/fault-tolerance.md."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "fault-tolerance.md").read_text()
    section = page.split("## What an operator sees", 1)[1]
    return section.split("```json\n", 1)[1].split("```", 1)[0]


def key_tree(value: object) -> object:
    """The keys of a JSON value, recursively (lists by their first item)."""
    if isinstance(value, dict):
        return {key: key_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [key_tree(value[0])] if value and isinstance(value[0], dict | list) else []
    return None


def status(server: DaemonServer) -> daemon_pb2.StatusResponse:
    with grpc.insecure_channel(server.address) as channel:
        return daemon_pb2_grpc.DaemonStub(channel).Status(daemon_pb2.StatusRequest(), timeout=10)


def job_metrics(server: DaemonServer) -> daemon_pb2.GetMetricsResponse:
    with grpc.insecure_channel(server.address) as channel:
        request = daemon_pb2.GetMetricsRequest(job_id=JOB, window_steps=10)
        return daemon_pb2_grpc.DaemonStub(channel).GetMetrics(request, timeout=10)


def lighthouse_quorum(address: str) -> None:
    """Both groups heartbeat and form quorum 1 at the hosted lighthouse (torchft's client)."""
    from torchft._torchft import LighthouseClient

    def join(replica_id: str) -> None:
        client = LighthouseClient(f"http://{address}", timedelta(seconds=5))
        client.heartbeat(replica_id)
        client.quorum(replica_id=replica_id, timeout=timedelta(seconds=20), step=0, world_size=2)

    threads = [threading.Thread(target=join, args=(r,)) for r in REPLICA_IDS.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)


def test_two_replica_groups_leave_and_heal_in_plait_status(
    server: DaemonServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert server.lighthouse is not None
    lighthouse_quorum(server.lighthouse.address)
    channel = grpc.insecure_channel(server.address)
    groups = {index: Group(channel, index) for index in (0, 1)}
    try:
        groups[0].event("join", 1, 0, 2)
        groups[1].event("join", 1, 0, 2)
        for group in groups.values():
            group.steps(4)

        # Two worlds of one job: four ranks, group 1's rank 0 did not replace group 0's.
        with grpc.insecure_channel(server.address) as ch:
            ranks = daemon_pb2_grpc.DaemonStub(ch).ListRanks(
                daemon_pb2.ListRanksRequest(job_id=JOB), timeout=10
            )
        assert sorted((r.replica_group, r.rank, r.status) for r in ranks.ranks) == [
            (0, 0, "live"), (0, 1, "live"), (1, 0, "live"), (1, 1, "live"),
        ]  # fmt: skip
        (job,) = job_metrics(server).jobs
        # Each group's world counts its own steps: FLOPS per STEP_SECONDS, added up.
        both = FLOPS / STEP_SECONDS[0] + FLOPS / STEP_SECONDS[1]
        assert (job.ranks_reporting, job.world_size, job.restarts) == (4, 4, 0)
        assert job.model_flops_per_second == pytest.approx(both, rel=1e-6)
        assert job.peak_flops == pytest.approx(4 * PEAK)
        assert job.mfu == pytest.approx(both / (4 * PEAK), rel=1e-6)
        # Exported per rank, each group's ranks their own series (Prometheus, OTLP upstream).
        series = [
            tuple(sorted(p.attributes.items()))
            for p in daemon_points(server.service)
            if p.name == "plait.rank.step.duration"
        ]
        assert len(series) == len(set(series)) == 4

        # Group 1 is lost: silent from here. Group 0 sees the quorum shrink, its step fails once.
        groups[1].close()
        groups[0].event("failed_commit", 1, 2, 2, detail="a peer died in the step")
        groups[0].event("leave", 2, 2, 1)
        from torchft._torchft import LighthouseClient

        assert server.lighthouse is not None
        live = LighthouseClient(f"http://{server.lighthouse.address}", timedelta(seconds=5))
        deadline = time.monotonic() + 30
        while True:  # group 0 trains on, heartbeating; group 1 goes stale in the daemon's eyes
            groups[0].steps(1)
            live.heartbeat(REPLICA_IDS[0])
            answer = status(server)
            (ft,) = answer.fault_tolerant_jobs
            if {g.replica_group: g.state for g in ft.groups}[1] == "left":
                break
            assert time.monotonic() < deadline, answer
        assert [(g.replica_group, g.state, g.ranks_live) for g in ft.groups] == [
            (0, "participating", 2), (1, "left", 0),
        ]  # fmt: skip
        assert (ft.state, ft.quorum_id, ft.participants) == ("running", 2, 1)
        (job,) = job_metrics(server).jobs
        assert job.ranks_reporting == 2 and job.ranks_stale == 2
        assert job.model_flops_per_second == pytest.approx(FLOPS / STEP_SECONDS[0], rel=1e-6)
        assert job.peak_flops == pytest.approx(2 * PEAK)
        # The lighthouse, read live: group 1's last heartbeat is older than group 0's.
        house = answer.lighthouse
        assert house.address == server.lighthouse.address and not house.error
        assert house.quorum_id == 1
        ages = {(b.job_id, b.replica_group): b.age_seconds for b in house.heartbeats}
        assert set(ages) == {(JOB, 0), (JOB, 1)}
        assert ages[(JOB, 1)] > ages[(JOB, 0)]

        # Group 1 comes back (torchrun restarted it), joins and heals from group 0.
        groups[1] = Group(channel, 1)
        groups[1].step = groups[0].step
        groups[0].event("join", 3, 1, 2)
        groups[1].event("join", 3, 0, 2)
        groups[1].event("heal", 3, 0, 2, detail="from a live peer")
        groups[1].steps(2)
        groups[0].steps(1)

        monkeypatch.setattr(daemon_commands, "console", Console(width=200))
        shown = CliRunner().invoke(
            daemon_commands.app, ["status", "--json", "--host", server.address]
        )
        assert shown.exit_code == 0, shown.output
        (ft_json,) = json.loads(shown.output)["fault_tolerance"]
        assert [g["state"] for g in ft_json["groups"]] == ["participating", "participating"]
        assert (ft_json["quorum_id"], ft_json["participants"]) == (3, 2)
        assert [(e["replica_group"], e["kind"], e["quorum_id"]) for e in ft_json["events"]] == [
            (0, "join", 1), (1, "join", 1), (0, "failed_commit", 1), (0, "leave", 2),
            (0, "join", 3), (1, "join", 3), (1, "heal", 3),
        ]  # fmt: skip
        heal = ft_json["events"][-1]
        assert heal["replica_id"] == REPLICA_IDS[1] and heal["seconds"] == pytest.approx(0.05)
        assert heal["detail"] == "from a live peer" and heal["step"] == groups[0].step - 1
        (house_json,) = json.loads(shown.output)["lighthouses"]
        assert house_json["quorum_id"] == 1 and len(house_json["heartbeats"]) == 2
        # The page's example has exactly the keys plait prints.
        documented = json.loads(docs_json_example())
        assert key_tree(documented["fault_tolerance"][0]) == key_tree(ft_json)
        assert key_tree(documented["lighthouses"][0]) == key_tree(house_json)

        # And as text: the groups, the events, the lighthouse.
        text = CliRunner().invoke(daemon_commands.app, ["status", "--host", server.address])
        assert text.exit_code == 0, text.output
        assert f"replica groups of {JOB}" in text.output and "failed_commit" in text.output
        assert f"lighthouse {server.lighthouse.address}" in text.output
        assert "g1/0" in text.output  # group 1's rank 0 in the ranks table
    finally:
        for group in groups.values():
            group.close()
        channel.close()


def test_the_telemetry_plugin_sends_what_the_group_published(server: DaemonServer) -> None:
    """The rank side as the trainer drives it: events published on the board after a step are
    sent by the telemetry plugin at the next step boundary, under the rank's replica group."""
    from plait.core.config import load_config
    from plait.core.plugins import Plugins
    from plait.core.span_board import BOARD
    from plait.plugins.fault_tolerance.quorum_events import publish_quorum_events
    from plait.plugins.telemetry import make_plugin

    plugins = Plugins.create(autoload=False, builtins=())
    plugins.register(make_plugin(), "telemetry")
    plugins.configure(load_config({"telemetry": {"daemon": server.address}}))
    plugins.job_start(job_info(rank=0, world_size=1, job_id=JOB, replica_group=3))
    now = time.time_ns()
    heal = QuorumEvent(
        kind="heal", step=7, quorum_id=5, participants=2, previous=1,
        start_ns=now - 10**8, end_ns=now, detail="from a live peer",
    )  # fmt: skip
    publish_quorum_events([heal], replica_id=f"{JOB}-group3:cccc")
    plugins.step_start(7)
    assert BOARD.take() == []  # taken at the step's start, queued on the exporter
    plugins.step_end(
        StepReport(step=7, loss=1.0, tokens=64, step_seconds=0.1, data_wait_seconds=0.0,
                   model_flops=FLOPS, lr=1e-3, start_ns=now, end_ns=now + 10**8)
    )  # fmt: skip
    plugins.job_end()  # sends everything queued
    (ft,) = status(server).fault_tolerant_jobs
    ((group, state, ranks, quorum, replica_id),) = [
        (g.replica_group, g.state, list(g.ranks), g.quorum_id, g.replica_id) for g in ft.groups
    ]
    assert (group, state, ranks, quorum) == (3, "finished", [0], 5)
    assert replica_id == f"{JOB}-group3:cccc"
    ((kind, step, seconds, detail),) = [(e.kind, e.step, e.seconds, e.detail) for e in ft.events]
    assert (kind, step, detail) == ("heal", 7, "from a live peer")
    assert seconds == pytest.approx(0.1)


def test_a_hang_names_the_replica_group_of_its_ranks() -> None:
    """Group 1's rank 0 waits in an all-reduce its rank 1 never entered; group 0's rank 1 (in
    the same op of its own world) does not count as having entered group 1's."""
    from plait.daemon.hangs import Heartbeat, InflightOp, find_hangs

    now = time.time_ns()
    dp = ("dp", (0, 1))
    stuck = InflightOp("dp", (0, 1), "all_reduce", 7, "grad_bucket", now - 5 * 10**9)
    beats = {
        (JOB, 0, 0): Heartbeat(now, (), {dp: 9}),
        (JOB, 0, 1): Heartbeat(now, (), {dp: 9}),
        (JOB, 1, 0): Heartbeat(now, (stuck,), {dp: 7}),
        (JOB, 1, 1): Heartbeat(now, (), {dp: 6}),
    }
    (hang,) = find_hangs(beats, now_ns=now, timeout_seconds=2.0)
    assert (hang.replica_group, hang.entered_ranks, hang.missing_ranks) == (1, (0,), (1,))
    assert hang.describe().startswith(f"job {JOB} replica group 1: all_reduce seq 7")


@pytest.mark.parametrize(
    ("span_name", "attribute", "allowed"),
    [
        (schema.QUORUM_EVENT_SPAN_NAME, schema.SPAN_QUORUM_EVENT, schema.QUORUM_EVENTS),
        (schema.JOB_END_SPAN_NAME, schema.SPAN_JOB_OUTCOME, schema.JOB_OUTCOMES),
    ],
)
def test_an_unknown_event_or_outcome_is_rejected_naming_what_is_allowed(
    span_name: str, attribute: str, allowed: tuple[str, ...]
) -> None:
    from plait.daemon.decoder import OUT_OF_RANGE, Rejected, span_statics

    for value in allowed:  # each allowed value decodes
        span_statics(span_name, {schema.SPAN_STEP: 1, attribute: value})
    with pytest.raises(Rejected) as caught:
        span_statics(span_name, {schema.SPAN_STEP: 1, attribute: "exploded"})
    assert caught.value.attribute == attribute and caught.value.reason == OUT_OF_RANGE
    assert all(value in caught.value.detail for value in allowed)
