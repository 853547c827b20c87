"""Daemon security: bind policy, TLS and mTLS, bearer tokens, limits and hostile input."""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from plait.daemon import client_auth as daemon_auth
from plait.daemon import telemetry_schema as names
from plait.daemon.client_auth import DaemonClientAuth
from plait.daemon.security import SecurityConfig, SecurityError, is_loopback
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from tests.daemon.certs import TestPki, make_pki
from tests.daemon.daemon_fakes import FakeBackend, run_fake_rank

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_daemon(pki: TestPki) -> Iterator[DaemonServer]:
    security = SecurityConfig.create(tls_cert=pki.server_cert, tls_key=pki.server_key, token=TOKEN)
    server = DaemonServer("127.0.0.1:0", host_interval=0.2, security=security).start()
    try:
        yield server
    finally:
        server.stop(grace=0.5)


def status_code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()  # type: ignore[operator]
    return error.value.code()


def otlp_request(
    spans: int, *, attribute_bytes: int = 0
) -> trace_service_pb2.ExportTraceServiceRequest:
    resource_attributes = [
        KeyValue(key=names.RESOURCE_JOB_ID, value=AnyValue(string_value="sec")),
        KeyValue(key=names.RESOURCE_RANK, value=AnyValue(int_value=0)),
    ]
    padding = [KeyValue(key="padding", value=AnyValue(string_value="x" * attribute_bytes))]
    request = trace_service_pb2.ExportTraceServiceRequest()
    resource_spans = ResourceSpans(
        scope_spans=[ScopeSpans(spans=[
            Span(name=f"s{i}", start_time_unix_nano=1, end_time_unix_nano=2,
                 attributes=padding if attribute_bytes else [])
            for i in range(spans)
        ])]
    )  # fmt: skip
    resource_spans.resource.attributes.extend(resource_attributes)
    request.resource_spans.append(resource_spans)
    return request


def test_bind_policy() -> None:
    assert is_loopback("127.0.0.1:7461") and is_loopback("[::1]:1") and is_loopback("localhost:1")
    assert not is_loopback("0.0.0.0:7461") and not is_loopback("[::]:7461")
    assert not is_loopback("node7.cluster:7461")
    with pytest.raises(SecurityError, match=r"requires TLS .* and a bearer token .* --insecure"):
        DaemonServer("0.0.0.0:0", host_interval=0.2)
    with pytest.raises(SecurityError, match="bearer token"):
        SecurityConfig.create(tls_cert="c.pem", tls_key="k.pem").check_bind("10.0.0.5:7461")
    with pytest.raises(SecurityError, match="both a certificate"):
        SecurityConfig.create(tls_cert="c.pem")
    SecurityConfig.create(insecure=True).check_bind("0.0.0.0:7461")  # the explicit opt-out


def test_token_is_checked_on_every_call(tls_daemon: DaemonServer, pki: TestPki) -> None:
    anonymous = DaemonClientAuth(ca_cert=pki.ca.read_bytes())
    wrong = DaemonClientAuth(token="not-it", ca_cert=pki.ca.read_bytes())
    right = DaemonClientAuth(token=TOKEN, ca_cert=pki.ca.read_bytes())
    request = daemon_pb2.StatusRequest()
    for auth in (anonymous, wrong):
        with auth.channel(tls_daemon.address) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            assert status_code(lambda s=stub: s.Status(request, timeout=5)) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            stream = stub.StreamMetrics(daemon_pb2.StreamMetricsRequest(interval_seconds=0.1))
            assert status_code(lambda s=stream: next(s)) == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel)
            assert (
                status_code(lambda h=health: h.Check(health_pb2.HealthCheckRequest(), timeout=5))
                == grpc.StatusCode.UNAUTHENTICATED
            )
            otlp = trace_service_pb2_grpc.TraceServiceStub(channel)
            assert (
                status_code(lambda o=otlp: o.Export(otlp_request(1), timeout=5))
                == grpc.StatusCode.UNAUTHENTICATED
            )
    with right.channel(tls_daemon.address) as channel:
        status = daemon_pb2_grpc.DaemonStub(channel).Status(request, timeout=5)
    assert status.calls_rejected == 8 and status.spans_received == 0
    # Plaintext to a TLS port never reaches a handler.
    with grpc.insecure_channel(tls_daemon.address) as channel:
        assert (
            status_code(lambda: daemon_pb2_grpc.DaemonStub(channel).Status(request, timeout=3))
            == grpc.StatusCode.UNAVAILABLE
        )


def test_rank_exports_over_tls_with_token(
    tls_daemon: DaemonServer, pki: TestPki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(daemon_auth.TOKEN_ENV, TOKEN)
    monkeypatch.setenv(daemon_auth.CA_CERT_ENV, str(pki.ca))
    run_fake_rank(tls_daemon.address, rank=0, steps=2, backend=FakeBackend())
    with DaemonClientAuth.from_env().channel(tls_daemon.address) as channel:
        ranks = daemon_pb2_grpc.DaemonStub(channel).ListRanks(daemon_pb2.ListRanksRequest())
    assert [(r.rank, r.steps_received) for r in ranks.ranks] == [(0, 2)]


def test_mutual_tls_requires_a_client_certificate(pki: TestPki) -> None:
    security = SecurityConfig.create(
        tls_cert=pki.server_cert, tls_key=pki.server_key, client_ca=pki.ca, token=TOKEN
    )
    with DaemonServer("127.0.0.1:0", host_interval=0.2, security=security) as server:
        without = DaemonClientAuth(token=TOKEN, ca_cert=pki.ca.read_bytes())
        with without.channel(server.address) as channel:
            assert status_code(
                lambda: daemon_pb2_grpc.DaemonStub(channel).Status(daemon_pb2.StatusRequest(),
                                                                   timeout=3)
            ) == grpc.StatusCode.UNAVAILABLE  # fmt: skip
        with_cert = DaemonClientAuth(
            token=TOKEN,
            ca_cert=pki.ca.read_bytes(),
            client_cert=pki.client_cert.read_bytes(),
            client_key=pki.client_key.read_bytes(),
        )
        with with_cert.channel(server.address) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            assert stub.Status(daemon_pb2.StatusRequest(), timeout=5).version


def test_hostile_input_gets_statuses_and_the_daemon_stays_up() -> None:
    with DaemonServer(
        "127.0.0.1:0", host_interval=0.2, max_message_bytes=64 * 1024, ingest_capacity=50,
        max_streams=1,
    ) as server:  # fmt: skip
        host, port = server.address.rsplit(":", 1)
        # Random bytes, and an HTTP/2 preface followed by garbage frames, straight to the port.
        generator = random.Random(0)
        for preface in (b"", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"):
            for _ in range(3):
                with socket.create_connection((host, int(port)), timeout=2) as raw:
                    raw.sendall(preface + generator.randbytes(8192))
                    raw.settimeout(1)
                    with contextlib.suppress(TimeoutError, ConnectionError):
                        raw.recv(1024)  # whatever the server answers before closing
        with grpc.insecure_channel(server.address) as channel:
            stub = daemon_pb2_grpc.DaemonStub(channel)
            # Bytes that are not a GetMetricsRequest.
            raw_call = channel.unary_unary("/plait.v1.Daemon/GetMetrics")
            assert (
                status_code(lambda: raw_call(b"\xff\xff\xff\xff", timeout=5))
                == grpc.StatusCode.INVALID_ARGUMENT
            )
            raw_export = channel.unary_unary(
                "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
            )
            assert (
                status_code(lambda: raw_export(os.urandom(64) + b"\x0a\xff", timeout=5))
                == grpc.StatusCode.INVALID_ARGUMENT
            )
            # Over the message size limit: INVALID_ARGUMENT, which no OTLP exporter retries;
            # past the transport's headroom, gRPC's own RESOURCE_EXHAUSTED.
            otlp = trace_service_pb2_grpc.TraceServiceStub(channel)
            assert (
                status_code(
                    lambda: otlp.Export(otlp_request(1, attribute_bytes=200_000), timeout=5)
                )
                == grpc.StatusCode.INVALID_ARGUMENT
            )
            assert (
                status_code(
                    lambda: otlp.Export(otlp_request(1, attribute_bytes=300_000), timeout=5)
                )
                == grpc.StatusCode.RESOURCE_EXHAUSTED
            )
            # Over the ingest capacity: dropped, counted, and told through partial success.
            response = otlp.Export(otlp_request(60), timeout=5)
            assert response.partial_success.rejected_spans == 60
            assert otlp.Export(otlp_request(10), timeout=5).partial_success.rejected_spans == 0
            # Over the long-lived call limit.
            first = stub.StreamMetrics(daemon_pb2.StreamMetricsRequest(interval_seconds=0.05))
            next(first)
            second = stub.StreamMetrics(daemon_pb2.StreamMetricsRequest(interval_seconds=0.05))
            assert status_code(lambda: next(second)) == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.cancel()
            # The daemon gives the slot back when it sees the cancel, in its own time: wait on
            # the guard's own semaphore for it (what the next call will take) instead of a nap.
            slots = server.guard._long_lived
            assert slots.acquire(timeout=60), "the cancelled stream's slot was never given back"
            slots.release()
            third = stub.StreamMetrics(daemon_pb2.StreamMetricsRequest(interval_seconds=0.05))
            assert next(third).host.hostname  # the slot was given back
            third.cancel()
            status = stub.Status(daemon_pb2.StatusRequest(), timeout=5)
        assert (status.spans_received, status.spans_dropped) == (10, 60)
        assert status.ingest_queue_capacity == 50
        assert status.calls_rejected >= 4  # two malformed, one oversize, one over the streams
        assert dict(status.calls_rejected_by_reason) == {
            "malformed": 2,
            "oversize": 1,
            "over_limit": 1,
        }


def test_token_file_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    assert SecurityConfig.create(token_file=token_file).token == TOKEN
    monkeypatch.setenv(daemon_auth.TOKEN_ENV, "from-env")
    assert SecurityConfig.create().token == "from-env"
