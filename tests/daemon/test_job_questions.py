"""One job across its daemons: the directory the ranks report, `AskJob`'s fan-out, and each
bad peer (dead, stopped, wrong job, garbage, older plait, lying) named and left out.

Two real daemons hold one job's ranks (rank 0 on A, rank 1 on B, steps sent over OTLP as a
rank's exporter sends them); node lists arrive with a poll as a node's first rank sends them.
The bad peers are real sockets and gRPC servers: a port nobody listens on, a listener that
accepts and never answers (what a SIGSTOPped daemon's kernel does), an HTTP server, a
`Daemon` service of an older plait, and one that answers for another job or host.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import typer
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from rich.console import Console
from typer.testing import CliRunner

from plait.core.host import host_name
from plait.core.host_map import HostMap
from plait.daemon.config import DaemonConfig
from plait.daemon.job_directory import JobNode, seen_from
from plait.daemon.security import SecurityConfig
from plait.daemon.server import DaemonServer
from plait.plugins.telemetry.control_client import ControlClient
from plait.plugins.telemetry.job_nodes import JobNodes
from plait.proto.plait.v1 import (
    control_pb2,
    control_pb2_grpc,
    daemon_pb2,
    daemon_pb2_grpc,
    metrics_pb2,
)
from plait.tools import daemon_commands, prometheus_commands
from plait.tools.daemon_targets import Targets, read_hosts_file
from tests.daemon.certs import make_pki
from tests.daemon.daemon_fakes import job_info
from tests.daemon.otlp_inputs import rank_resource, step_spans, trace_request
from tests.free_ports import refused_port

JOB = "fleet"
HOST = host_name()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon_commands, "console", Console(width=240))


@pytest.fixture
def pair() -> Iterator[tuple[DaemonServer, DaemonServer]]:
    config = DaemonConfig(bind="127.0.0.1:0", host_interval=0.5)
    with DaemonServer(config=config) as a, DaemonServer(config=config) as b:
        yield a, b


def send_rank(daemon: DaemonServer, rank: int, world: int = 2, steps: int = 4) -> None:
    """`steps` steps of `rank` of JOB, as the rank's exporter sends them."""
    request = trace_request(
        rank_resource(JOB, rank, world), step_spans(0, steps, time.time_ns() - 10**9)
    )
    with grpc.insecure_channel(daemon.address) as channel:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=10)


def poll(
    daemon: DaemonServer, rank: int, nodes: list[control_pb2.JobNode], self_node: int, **kw
) -> control_pb2.PollResponse:
    with grpc.insecure_channel(daemon.address) as channel:
        return control_pb2_grpc.ControlStub(channel).Poll(
            control_pb2.PollRequest(
                job_id=JOB, rank=rank, world_size=max(2, len(nodes)), host=f"h{rank}",
                pid=1000 + rank,
                job_nodes=nodes, self_node=self_node, **kw,
            ),
            timeout=5,
        )  # fmt: skip


def nodes_of(*addresses: str) -> list[control_pb2.JobNode]:
    """One node per address, node i holding rank i, all on this machine (as two torchrun
    agents on one machine are two nodes): loopback addresses stay as they are."""
    return [
        control_pb2.JobNode(node=i, host=HOST, daemon=a, ranks=[i]) for i, a in enumerate(addresses)
    ]


def report_job(a: DaemonServer, b: DaemonServer, *extra: str) -> None:
    """Each node's first rank sends the job's node list to its own daemon."""
    nodes = nodes_of(a.address, b.address, *extra)
    poll(a, 0, nodes, 0)
    poll(b, 1, nodes, 1)


def ask(via: DaemonServer, deadline: float = 3.0, **kw) -> daemon_pb2.AskJobResponse:
    request = daemon_pb2.AskJobRequest(
        job_id=JOB,
        questions=[
            daemon_pb2.JobQuestion(
                method="Daemon/GetMetrics",
                request=daemon_pb2.GetMetricsRequest(job_id=JOB).SerializeToString(),
            )
        ],
        deadline_seconds=deadline,
        **kw,
    )
    with grpc.insecure_channel(via.address) as channel:
        return daemon_pb2_grpc.DaemonStub(channel).AskJob(request, timeout=deadline + 5)


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(daemon_commands.app, list(args), env=env)
    return result.exit_code, result.output


# -- the directory -------------------------------------------------------------------------------


def test_a_loopback_daemon_of_another_host_is_reached_by_that_host_name() -> None:
    node = JobNode(node=1, host="node-b", daemon="127.0.0.1:7461", ranks=(8,))
    assert seen_from(node, here="node-a") == "node-b:7461"
    assert seen_from(node, here="node-b") == "127.0.0.1:7461"
    routable = JobNode(node=1, host="node-b", daemon="10.0.0.2:7461", ranks=(8,))
    assert seen_from(routable, here="node-a") == "10.0.0.2:7461"
    assert seen_from(JobNode(1, "node-b", "localhost:7461", ()), "node-a") == "node-b:7461"


def test_the_first_poll_carries_the_node_list_and_the_daemon_asks_again_after_a_restart(
    pair: tuple[DaemonServer, DaemonServer],
) -> None:
    a, b = pair
    assert poll(a, 0, [], 0).wants_job_nodes  # nothing known yet: send it
    assert not poll(a, 0, nodes_of(a.address, b.address), 0).wants_job_nodes
    assert not poll(a, 0, [], 0).wants_job_nodes
    with grpc.insecure_channel(a.address) as channel:
        listing = daemon_pb2_grpc.DaemonStub(channel).ListJobDaemons(
            daemon_pb2.ListJobDaemonsRequest(job_id=JOB), timeout=5
        )
    assert [(d.node, d.host, d.address, list(d.ranks)) for d in listing.daemons] == [
        (0, HOST, a.address, [0]),
        (1, HOST, b.address, [1]),
    ]
    # A new world (an elastic restart, one node left) replaces the old list.
    poll(a, 0, nodes_of(a.address), 0)
    with grpc.insecure_channel(a.address) as channel:
        listing = daemon_pb2_grpc.DaemonStub(channel).ListJobDaemons(
            daemon_pb2.ListJobDaemonsRequest(job_id=JOB), timeout=5
        )
    assert [d.address for d in listing.daemons] == [a.address]


def test_a_bad_node_list_is_dropped_and_counted_while_the_poll_counts(
    pair: tuple[DaemonServer, DaemonServer],
) -> None:
    a, _ = pair
    bad = [control_pb2.JobNode(node=0, host="x", daemon="no-port", ranks=[0])]
    response = poll(a, 0, bad, 0)
    assert response.daemon_unix_nano > 0  # the poll itself was taken
    assert a.control_service.bad_job_nodes == 1
    assert not a.directory.knows(JOB, -1)


# -- asking the whole job -----------------------------------------------------------------------


def test_every_daemon_of_the_job_answers_through_any_one_of_them(
    pair: tuple[DaemonServer, DaemonServer],
) -> None:
    a, b = pair
    send_rank(a, 0)
    send_rank(b, 1)
    report_job(a, b)
    for via in (a, b):
        reply = ask(via)
        assert [(x.node, x.address, x.error) for x in reply.answers] == [
            (0, a.address, ""),
            (1, b.address, ""),
        ]
        ranks = sorted(
            r.rank
            for answer in reply.answers
            for r in daemon_pb2.GetMetricsResponse.FromString(answer.responses[0]).ranks
        )
        assert ranks == [0, 1]
        # Sized by ranks, not spans: one node's reply for its ranks is small.
        assert all(len(x.responses[0]) < 4096 for x in reply.answers)


def test_top_and_status_for_a_job_equal_the_answer_of_every_host_listed(
    pair: tuple[DaemonServer, DaemonServer],
) -> None:
    a, b = pair
    send_rank(a, 0)
    send_rank(b, 1)
    report_job(a, b)
    env = {"PLAIT_DAEMON": a.address}
    code, job_wide = cli("top", "--json", "--job", JOB, env=env)
    assert code == 0, job_wide
    code, listed = cli("top", "--json", "--job", JOB, "--host", a.address, "--host", b.address)
    assert code == 0, listed
    wide, hosts = json.loads(job_wide), json.loads(listed)
    assert wide["job_daemons"]["answered"] == wide["job_daemons"]["asked"] == 2
    assert [r["rank"] for r in wide["ranks"]] == [r["rank"] for r in hosts["ranks"]] == [0, 1]
    same = ("world_size", "ranks_reporting", "tokens_per_second", "model_flops_per_second", "mfu")
    for key in same:
        assert wide["jobs"][0][key] == hosts["jobs"][0][key], key
    code, status = cli("status", "--job", JOB, env=env)
    assert code == 0, status
    assert "2/2 daemons of job fleet answered" in status


# -- bad peers, each named and left out ---------------------------------------------------------


class _Silent:
    """A listener that accepts connections and never answers: a stopped daemon."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


class _Http(_Silent):
    """An HTTP/1.1 server where a daemon should be: garbage to gRPC."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
            conn.close()

    def close(self) -> None:
        self.stop.set()
        super().close()


class _OlderDaemon(daemon_pb2_grpc.DaemonServicer):
    """A plait daemon from before job questions: no AskJob (the base class answers
    UNIMPLEMENTED)."""


class _Liar(daemon_pb2_grpc.DaemonServicer):
    """Answers every job question, for the job and host it chooses."""

    def __init__(self, job_id: str, host: str, protocol: int = 1) -> None:
        self.job_id, self.host, self.protocol = job_id, host, protocol

    def AskJob(self, request, context):  # the RPC's name
        return daemon_pb2.AskJobResponse(
            job_id=self.job_id,
            protocol=self.protocol,
            answers=[
                daemon_pb2.DaemonAnswer(
                    host=self.host,
                    job_id=self.job_id,
                    protocol=self.protocol,
                    responses=[b"" for _ in request.questions],
                )
            ],
        )


def _grpc_server(servicer: daemon_pb2_grpc.DaemonServicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    daemon_pb2_grpc.add_DaemonServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.timeout(120)
def test_each_bad_peer_is_named_and_left_out_within_the_deadline(
    pair: tuple[DaemonServer, DaemonServer],
) -> None:
    a, b = pair
    send_rank(a, 0)
    send_rank(b, 1)
    silent, http = _Silent(), _Http()
    older, older_address = _grpc_server(_OlderDaemon())
    other_job, other_job_address = _grpc_server(_Liar("another-job", HOST))
    other_host, other_host_address = _grpc_server(_Liar(JOB, "somewhere-else"))
    old_protocol, old_protocol_address = _grpc_server(_Liar(JOB, HOST, protocol=0))
    wrong_job_daemon = DaemonServer("127.0.0.1:0").start()  # a real daemon without the job
    try:
        with refused_port() as dead_port:
            peers = [
                f"127.0.0.1:{dead_port}",  # node2: dead
                silent.address,  # node3: stopped
                wrong_job_daemon.address,  # node4: holds no such job
                http.address,  # node5: garbage
                older_address,  # node6: older plait
                other_job_address,  # node7: answers for another job
                other_host_address,  # node8: answers as another host
                old_protocol_address,  # node9: an older protocol
            ]
            report_job(a, b, *peers)
            deadline = 2.0
            started = time.monotonic()
            reply = ask(a, deadline=deadline)
            elapsed = time.monotonic() - started
        errors = {x.node: x.error for x in reply.answers}
        assert errors[0] == errors[1] == ""
        assert errors[2].startswith("unreachable"), errors[2]
        assert "no answer within the 2 s deadline" in errors[3], errors[3]
        assert errors[4] == "holds no job 'fleet'", errors[4]
        assert errors[5], "an HTTP server's bytes were taken as an answer"
        assert "older plait daemon" in errors[6], errors[6]
        assert errors[7] == "answered for job 'another-job', not 'fleet'", errors[7]
        assert "answered as host 'somewhere-else'" in errors[8], errors[8]
        assert "older plait" in errors[9], errors[9]
        # The stopped peer never answers: only the deadline ends the wait (a generous bound:
        # the machine may be busy, and without the deadline this would never return).
        assert elapsed < deadline + 5, elapsed

        # Through the CLI: the answer says how many answered and names each missing node.
        code, out = cli(
            "top", "--once", "--job", JOB, "--deadline", "2", env={"PLAIT_DAEMON": a.address}
        )
        assert code == 1, out
        text = " ".join(out.split())
        assert "2/10 daemons of job fleet answered" in text, out
        for node in range(2, 10):
            assert f"node{node} (" in text, (node, out)
    finally:
        silent.close()
        http.close()
        for server in (older, other_job, other_host, old_protocol):
            server.stop(0)
        wrong_job_daemon.stop(0)


def test_a_daemon_stopped_mid_job_is_named_missing_and_the_rest_still_answer(
    pair: tuple[DaemonServer, DaemonServer],
) -> None:
    a, b = pair
    send_rank(a, 0)
    send_rank(b, 1)
    report_job(a, b)
    b.stop(0)
    env = {"PLAIT_DAEMON": a.address}
    code, out = cli("top", "--json", "--job", JOB, "--deadline", "2", env=env)
    assert code == 1
    document = json.loads(out)
    assert document["job_daemons"]["answered"] == 1
    assert [m["node"] for m in document["job_daemons"]["missing"]] == [1]
    assert [r["rank"] for r in document["ranks"]] == [0]


def test_prometheus_targets_lists_every_daemon_of_the_job_with_its_node() -> None:
    config = DaemonConfig(bind="127.0.0.1:0", host_interval=0.5, prometheus="127.0.0.1:0")
    with DaemonServer(config=config) as a, DaemonServer(config=config) as b:
        send_rank(a, 0)
        send_rank(b, 1)
        report_job(a, b)
        result = CliRunner().invoke(
            prometheus_commands.app,
            ["prometheus-targets", "--job", JOB],
            env={"PLAIT_DAEMON": a.address},
        )
        assert result.exit_code == 0, result.output
        groups = json.loads(result.stdout)
        assert {g["targets"][0]: g["labels"]["plait_node"] for g in groups} == {
            a.prometheus.address: "0",
            b.prometheus.address: "1",
        }
        assert all(g["labels"]["plait_job_id"] == JOB for g in groups)


# -- the rank side -----------------------------------------------------------------------------


def test_a_nodes_first_rank_tells_its_daemon_once_and_again_when_the_daemon_forgot(
    pair: tuple[DaemonServer, DaemonServer],
) -> None:
    a, b = pair
    host_map = HostMap(node_of_rank=(0, 0, 1, 1), hosts=(HOST, HOST))
    addresses = [a.address, a.address, b.address, b.address]
    first, second = (JobNodes.from_addresses(host_map, addresses, rank) for rank in (2, 3))
    assert first.reporter and not second.reporter and first.self_node == 1
    assert [(n.node, n.daemon, list(n.ranks)) for n in first.nodes] == [
        (0, a.address, [0, 1]),
        (1, b.address, [2, 3]),
    ]
    with grpc.insecure_channel(b.address) as channel:
        clients = [
            ControlClient(
                channel=channel, info=job_info(rank, 4, JOB), flush_spans=lambda t: True,
                interval=3600,
            )
            for rank in (2, 3)
        ]  # fmt: skip
        clients[0].job_nodes, clients[1].job_nodes = first, second
        clients[1].poll()  # not its node's first rank: it never sends the list
        assert not b.directory.knows(JOB, -1)
        clients[0].poll()
        assert [n.daemon for n in b.directory.reports(JOB)[0].nodes] == addresses[::2]
        sent = []
        original = b.control_service._note_job_nodes

        def spy(request: control_pb2.PollRequest) -> bool:
            sent.append(len(request.job_nodes))
            return original(request)

        b.control_service._note_job_nodes = spy  # type: ignore[method-assign]
        clients[0].poll()
        assert sent == [0]  # known: not sent again
        b.directory._reports.clear()  # the daemon restarted and forgot
        clients[0].poll()  # told that the daemon lacks it...
        clients[0].poll()  # ...it sends it again
        assert sent == [0, 0, 2]
        assert b.directory.knows(JOB, -1)


def test_a_hosts_file_or_the_slurm_node_list_names_the_daemons_of_a_job_plait_did_not_launch(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listed = tmp_path / "hosts"
    listed.write_text("# the job's nodes\ngpu01:7461\n\ngpu02:7461  # second\n")
    assert read_hosts_file(listed) == ["gpu01:7461", "gpu02:7461"]
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-02],login1")
    assert read_hosts_file(Path("slurm:9000")) == ["gpu01:9000", "gpu02:9000", "login1:9000"]
    assert read_hosts_file(Path("slurm"))[0] == "gpu01:7461"
    targets = Targets.resolve(None, JOB, Path("slurm"))
    assert not targets.job_wide and len(targets.hosts) == 3
    monkeypatch.delenv("SLURM_JOB_NODELIST")
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    with pytest.raises(typer.BadParameter, match="SLURM_JOB_NODELIST"):
        read_hosts_file(Path("slurm"))


# -- daemon to daemon under TLS and a token ------------------------------------------------------


def test_daemons_ask_each_other_with_the_fleets_tls_roots_and_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = make_pki(tmp_path)
    token = tmp_path / "token"
    token.write_text("fleet-secret\n")
    security = SecurityConfig.create(
        tls_cert=pki.server_cert, tls_key=pki.server_key, token_file=token
    )
    monkeypatch.setenv("PLAIT_DAEMON_CA_CERT", str(pki.ca))  # the fleet's CA, for its peers
    monkeypatch.delenv("PLAIT_DAEMON_TOKEN", raising=False)  # the token: each daemon's own
    config = DaemonConfig(bind="127.0.0.1:0", host_interval=0.5, security=security)
    with DaemonServer(config=config) as a, DaemonServer(config=config) as b:
        for daemon, rank in ((a, 0), (b, 1)):
            credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
            auth = (("authorization", "Bearer fleet-secret"),)
            with grpc.secure_channel(daemon.address, credentials) as channel:
                request = trace_request(
                    rank_resource(JOB, rank, 2), step_spans(0, 4, time.time_ns() - 10**9)
                )
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(
                    request, timeout=10, metadata=auth
                )
                nodes = nodes_of(a.address, b.address)
                control_pb2_grpc.ControlStub(channel).Poll(
                    control_pb2.PollRequest(job_id=JOB, rank=rank, world_size=2, host=f"h{rank}",
                                            pid=1, job_nodes=nodes, self_node=rank),
                    timeout=10, metadata=auth,
                )  # fmt: skip
        env = {"PLAIT_DAEMON": a.address, "PLAIT_DAEMON_CA_CERT": str(pki.ca),
               "PLAIT_DAEMON_TOKEN": "fleet-secret"}  # fmt: skip
        code, out = cli("top", "--json", "--job", JOB, env=env)
        assert code == 0, out
        assert json.loads(out)["job_daemons"]["answered"] == 2
        # A daemon holding another token is refused by its peers, and names them missing.
        other = tmp_path / "other-token"
        other.write_text("other-secret\n")
        lone_config = DaemonConfig(
            bind="127.0.0.1:0",
            host_interval=0.5,
            security=SecurityConfig.create(
                tls_cert=pki.server_cert, tls_key=pki.server_key, token_file=other
            ),
        )
        with DaemonServer(config=lone_config) as lone:
            credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
            with grpc.secure_channel(lone.address, credentials) as channel:
                control_pb2_grpc.ControlStub(channel).Poll(
                    control_pb2.PollRequest(job_id=JOB, rank=0, world_size=2, host="h0", pid=1,
                                            job_nodes=nodes_of(lone.address, b.address),
                                            self_node=0),
                    timeout=10, metadata=(("authorization", "Bearer other-secret"),),
                )  # fmt: skip
            lone_env = {**env, "PLAIT_DAEMON": lone.address, "PLAIT_DAEMON_TOKEN": "other-secret"}
            code, out = cli("top", "--json", "--job", JOB, env=lone_env)
        assert code == 1, out
        (missing,) = json.loads(out)["job_daemons"]["missing"]
        assert missing["node"] == 1 and "UNAUTHENTICATED" in missing["error"], missing


class _OlderWithMetrics(daemon_pb2_grpc.DaemonServicer):
    """A daemon of an older plait: metrics for its node, no job questions."""

    def GetMetrics(self, request, context):  # the RPC's name
        return daemon_pb2.GetMetricsResponse(
            ranks=[metrics_pb2.RankMetrics(job_id=request.job_id, rank=0, host="old")]
        )


def test_the_local_daemon_of_an_older_plait_answers_for_its_own_node() -> None:
    server, address = _grpc_server(_OlderWithMetrics())
    try:
        code, out = cli("top", "--json", "--job", JOB, env={"PLAIT_DAEMON": address})
    finally:
        server.stop(0)
    assert code == 0, out
    document = json.loads(out)
    assert [r["rank"] for r in document["ranks"]] == [0]
    assert "job_daemons" not in document  # asked directly: no fan-out to count
