"""The control channel over real gRPC: a rank's own client (`ControlClient`, torch.profiler on
CPU) beside a hand-driven rank, against a daemon on loopback. One rank going quiet loses
nothing of the other; stacks come from a thread that is blocked; the door and the rules hold.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
import torch
from typer.testing import CliRunner

from plait.core.step import JobInfo
from plait.daemon.control_records import ControlLimits
from plait.daemon.security import SecurityConfig
from plait.daemon.server import DaemonServer
from plait.plugins.telemetry.control_client import ControlClient
from plait.proto.plait.v1 import control_pb2, control_pb2_grpc, daemon_pb2, daemon_pb2_grpc
from plait.tools.cli import app

JOB = "svc"
WAIT = 60.0


def job_info(rank: int) -> JobInfo:
    return JobInfo(
        job_id=JOB, rank=rank, local_rank=rank, world_size=2, host="node-a",
        degrees={"dp": 2}, coordinates={"dp": rank}, device="cpu", device_name="cpu",
        compute_dtype="float32", model_name="m", num_params=1, flops_per_token=1.0,
        tokens_per_step=1, memory_report=lambda: {"parameters": 4096, "gradients": 0,
                                                  "optimizer_state": 8192, "total": 12288},
    )  # fmt: skip


@dataclass
class RealRank:
    """Rank 0: the real client, a training loop thread and an exporter-like ticking thread."""

    client: ControlClient
    stop: threading.Event = field(default_factory=threading.Event)
    block: threading.Event = field(default_factory=threading.Event)  # park the training thread
    release: threading.Event = field(default_factory=threading.Event)  # and let it go
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.threads = [
            threading.Thread(target=self.train, name="training", daemon=True),
            threading.Thread(target=self.export, name="exporter", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def train(self) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 32)
        step = 0
        while not self.stop.is_set():
            if self.block.is_set():
                blocked_in_a_wait(self.release)
                continue
            self.client.step_started(step)
            model(torch.randn(16, 32)).square().sum().backward()
            self.client.step_finished(step)
            step += 1
            time.sleep(0.01)

    def export(self) -> None:
        while not self.stop.wait(0.05):
            self.client.tick()


def blocked_in_a_wait(release: threading.Event) -> None:
    """Where the training thread sits while parked (what `Stacks` must show)."""
    release.wait()


def wait_for(predicate, what: str, timeout: float = WAIT) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonServer]:
    limits = ControlLimits(poll_patience_seconds=3.0, max_chunk_bytes=64 * 1024)
    with DaemonServer("127.0.0.1:0", host_interval=60.0, control=limits) as server:
        yield server


@pytest.fixture(scope="module")
def rank0(daemon: DaemonServer) -> Iterator[RealRank]:
    channel = grpc.insecure_channel(daemon.address)
    client = ControlClient(channel=channel, info=job_info(0), flush_spans=lambda t: True,
                           interval=0.05)  # fmt: skip
    rank = RealRank(client)
    rank.start()
    wait_for(lambda: client.polls > 0 and client.step > 2, "rank 0 to poll and step")
    yield rank
    rank.stop.set()
    rank.release.set()
    for thread in rank.threads:
        thread.join(timeout=30)
    client.close()
    channel.close()


@pytest.fixture
def stub(daemon: DaemonServer) -> Iterator[control_pb2_grpc.ControlStub]:
    channel = grpc.insecure_channel(daemon.address)
    yield control_pb2_grpc.ControlStub(channel)
    channel.close()


def poll(stub: control_pb2_grpc.ControlStub, rank: int, step: int, **kw: object) -> list:
    request = control_pb2.PollRequest(job_id=JOB, rank=rank, world_size=2, host="node-b",
                                      pid=999, step=step, **kw)  # type: ignore[arg-type]  # fmt: skip
    return list(stub.Poll(request).orders)


def test_a_rank_that_goes_quiet_mid_capture_is_named_and_the_other_trace_is_kept(
    rank0: RealRank, stub: control_pb2_grpc.ControlStub
) -> None:
    poll(stub, 1, step=rank0.client.step)  # rank 1 registers, then answers one order only
    prepared: dict = {}

    def operator() -> None:
        request = control_pb2.ProfileRequest(job_id=JOB, steps=2, timeout_seconds=WAIT)
        prepared["prepare"] = stub.PrepareProfile(request)
        collect = control_pb2.CollectProfileRequest(
            request_id=prepared["prepare"].request_id, timeout_seconds=WAIT
        )
        prepared["collect"] = stub.CollectProfile(collect)

    caller = threading.Thread(target=operator)
    caller.start()
    orders: list = []
    wait_for(lambda: bool(orders.extend(poll(stub, 1, step=rank0.client.step)) or orders),
             "rank 1's prepare order")  # fmt: skip
    (order,) = orders
    poll(stub, 1, step=rank0.client.step, ready=[order.request_id])  # ready; then silent
    caller.join(timeout=WAIT + 30)
    response = prepared["collect"]
    outcomes = {o.rank: o for o in response.outcomes}
    assert outcomes[0].state == "delivered"
    assert outcomes[1].state == "not polling" and "stopped polling" in outcomes[1].detail
    document = json.loads(gzip.decompress(response.trace_json_gz))
    assert document["otherData"]["processes"].keys() == {"0"}
    names = {e["name"] for e in document["traceEvents"] if e["ph"] == "X"}
    steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
    first = response.start_step
    assert steps == [f"ProfilerStep#{first}", f"ProfilerStep#{first + 1}"]
    assert "aten::addmm" in names or "aten::linear" in names
    (figures,) = response.analysis.ranks
    assert figures.rank == 0 and figures.steps == 2 and figures.compute_seconds > 0


def test_stacks_come_while_the_training_thread_is_blocked(
    rank0: RealRank, stub: control_pb2_grpc.ControlStub
) -> None:
    rank0.block.set()
    try:
        found: list = []

        def parked() -> bool:
            answer = stub.Stacks(control_pb2.StacksRequest(job_id=JOB, ranks=[0]))
            found[:] = [t for r in answer.ranks for t in r.threads if t.training]
            return bool(found) and found[0].frames[-1].function == "wait"

        wait_for(parked, "the training thread's stack while it is parked")
        functions = [f.function for f in found[0].frames]
        # threading.Event.wait, then Condition.wait: the thread sits in a lock acquire.
        assert functions[-3:] == ["blocked_in_a_wait", "wait", "wait"], functions
        assert found[0].name == "training"
    finally:
        rank0.block.clear()
        rank0.release.set()


def test_memory_meters_a_step_and_reports_the_model_state(
    rank0: RealRank, stub: control_pb2_grpc.ControlStub
) -> None:
    answer = stub.Memory(control_pb2.MemoryRequest(job_id=JOB, ranks=[0], step_wait_seconds=30))
    (outcome,) = answer.outcomes
    assert outcome.state == "delivered", outcome
    (report_file,) = [f for f in answer.files if f.name == "memory.json"]
    report = json.loads(report_file.data)
    assert report["model_state"]["optimizer_state"] == 8192
    # Linear(32, 32) on a (16, 32) batch saves its input and the square's input: 2 x 2 KiB.
    assert report["activations_saved_bytes"] >= 2 * 16 * 32 * 4
    assert report["rss_bytes"] > 0 and report["step"] >= 0
    assert not [f for f in answer.files if f.name == "snapshot.pickle"]  # CPU: no allocator


def test_bad_polls_and_oversized_chunks_are_refused_and_counted(
    daemon: DaemonServer, stub: control_pb2_grpc.ControlStub
) -> None:
    with pytest.raises(grpc.RpcError) as bad:
        stub.Poll(control_pb2.PollRequest(job_id=JOB, rank=2, world_size=2))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank: must be in [0, 2)" in bad.value.details()
    ack = stub.Deliver(control_pb2.DeliverChunk(request_id="x", job_id=JOB, data=b"a" * 70_000))
    assert not ack.accepted and "over 65536" in ack.reason
    ack = stub.Deliver(control_pb2.DeliverChunk(request_id="nope", job_id=JOB, data=b"a"))
    assert not ack.accepted and "no open request" in ack.reason
    status = daemon_pb2_grpc.DaemonStub(grpc.insecure_channel(daemon.address)).Status(
        daemon_pb2.StatusRequest()
    )
    assert status.control_rejected >= 2


def test_profile_arguments_are_checked_before_anything_is_asked(
    stub: control_pb2_grpc.ControlStub,
) -> None:
    for request, message in (
        (control_pb2.ProfileRequest(job_id=JOB), "give steps"),
        (control_pb2.ProfileRequest(job_id=JOB, steps=2, seconds=1), "give steps"),
        (control_pb2.ProfileRequest(job_id=JOB, steps=1000), "at most 100"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            stub.PrepareProfile(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in refused.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        stub.CollectProfile(control_pb2.CollectProfileRequest(request_id="profile-404"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_control_channel_needs_the_token_like_every_call() -> None:
    security = SecurityConfig(token="s3cret")
    with DaemonServer("127.0.0.1:0", host_interval=60.0, security=security) as server:
        channel = grpc.insecure_channel(server.address)
        with pytest.raises(grpc.RpcError) as refused:
            control_pb2_grpc.ControlStub(channel).Poll(
                control_pb2.PollRequest(job_id=JOB, rank=0, world_size=1)
            )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel.close()


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def test_extreme_numbers_at_the_control_door_are_refused_or_harmless(
    daemon: DaemonServer, stub: control_pb2_grpc.ControlStub
) -> None:
    base = {"job_id": "extremes", "rank": 0, "world_size": 2, "host": "h", "pid": 1, "step": 3}
    int32 = (-(2**31), -2, -1, 0, 2**31 - 1)
    int64 = (INT64_MIN, -2, -1, 0, INT64_MAX)
    fields = {"rank": int32, "world_size": int32, "pid": int64, "step": int64,
              "clock_offset_nano": int64, "clock_rtt_nano": int64}  # fmt: skip
    for name, values in fields.items():
        for value in values:
            request = control_pb2.PollRequest(**{**base, name: value})
            try:
                stub.Poll(request)
            except grpc.RpcError as refused:
                assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, value)
                assert refused.details().startswith(f"poll refused: {name}:"), refused.details()
    # The door's own bounds: a step the span decoder would refuse, a negative round trip.
    for name, value in (("step", INT64_MAX), ("step", -2), ("clock_rtt_nano", -1)):
        with pytest.raises(grpc.RpcError, match=f"poll refused: {name}"):
            stub.Poll(control_pb2.PollRequest(**{**base, name: value}))
    for name, value in (
        ("index", 2**31 - 1),
        ("total_bytes", INT64_MIN),
        ("first_step", INT64_MAX),
    ):
        ack = stub.Deliver(control_pb2.DeliverChunk(request_id="none", job_id="extremes",
                                                    **{name: value}))  # fmt: skip
        assert not ack.accepted and ack.reason
    (view,) = [v for v in daemon.control.endpoints("extremes", time.time_ns()) if v.polling]
    assert view.hello.step >= -1
    listed = stub.ListEndpoints(control_pb2.ListEndpointsRequest(job_id="extremes"))
    assert listed.endpoints
    result = CliRunner().invoke(
        app, ["stacks", "--job", "extremes", "--timeout", "1", "--json", "--host", daemon.address]
    )
    answer = json.loads(result.output)  # strict JSON, whatever the ranks said of themselves
    assert [o["state"] for o in answer["outcomes"]] == ["timed out"] and result.exit_code == 1
