"""Exporters with real clients on loopback: OTLP upstream to a receiver, Prometheus over HTTP."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from plait.daemon.exporters import UpstreamTarget
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc
from tests.daemon.daemon_fakes import FakeBackend, run_fake_rank
from tests.daemon.otlp_sink import OtlpSink


def test_upstream_target_follows_the_otlp_exporter_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ENDPOINT", "INSECURE", "HEADERS", "TRACES_ENDPOINT"):
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_{name}", raising=False)
    assert UpstreamTarget.resolve("TRACES") is None
    plain = UpstreamTarget.resolve("TRACES", "http://collector:4317")
    assert plain is not None and (plain.address, plain.insecure) == ("collector:4317", True)
    tls = UpstreamTarget.resolve("TRACES", "https://collector:4317")
    assert tls is not None and not tls.insecure
    bare = UpstreamTarget.resolve("TRACES", "collector:4317")
    assert bare is not None and not bare.insecure  # no scheme: TLS, as the SDK does
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=plait,authorization=Bearer%20t")
    metrics = UpstreamTarget.resolve("METRICS")
    traces = UpstreamTarget.resolve("TRACES")
    assert metrics is not None and (metrics.address, metrics.insecure) == ("collector:4317", True)
    assert traces is not None and traces.address == "traces:4317"
    assert metrics.headers == {"x-tenant": "plait", "authorization": "Bearer t"}


def test_forwards_upstream_and_serves_prometheus(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpSink() as sink:
        # The endpoint and headers come from the standard OpenTelemetry variables.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=plait")
        server = DaemonServer(
            "127.0.0.1:0", host_interval=0.2, otlp_endpoint="", prometheus="127.0.0.1:0"
        ).start()
        try:
            # Still running: finished jobs are not published.
            run_fake_rank(server.address, rank=0, steps=3, backend=FakeBackend(), finish=False)
            # The ranks' spans arrive upstream as they were sent, resource and all.
            assert sink.wait_for(
                lambda s: sum(r.get("plait.job.id") == "job-a" and sp.name == "step"
                              for r, sp in s.spans) == 3
            )  # fmt: skip
            assert all(m.get("x-tenant") == "plait" for m in sink.metadata)
            # The daemon's own figures, under its own resource.
            assert server.upstream is not None
            server.upstream.meter_provider.force_flush(5000)
            assert sink.wait_for(
                lambda s: any(r.get("service.name") == "plait-daemon" and m.name == "plait.job.mfu"
                              for r, m in s.metrics)
            )  # fmt: skip
            assert server.prometheus is not None
            url = f"http://{server.prometheus.address}/metrics"
            with urllib.request.urlopen(url, timeout=5) as response:
                assert response.status == 200
                text = response.read().decode()
            status = server.service.Status(None, None)  # type: ignore[arg-type]
            assert any(e.startswith("otlp http://127.0.0.1:") for e in status.exporters)
            assert any(e.startswith("prometheus http://127.0.0.1:") for e in status.exporters)
        finally:
            server.stop(grace=0.5)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (mfu,) = families["plait_job_mfu_ratio"].samples
    assert mfu.labels == {"plait_job_id": "job-a"} and mfu.value > 0
    classes = {
        s.labels["plait_bottleneck_class"]: s.value
        for s in families["plait_rank_bottleneck_seconds"].samples
    }
    # The fake rank's synthetic steps: 5 equal phases of 100 ms, data first.
    assert classes["data"] == pytest.approx(0.1, abs=0.01)  # minus comm issued in step 0
    assert classes["compute"] == pytest.approx(0.2, abs=1e-6)
    (received,) = families["plait_daemon_spans_received"].samples
    assert received.name == "plait_daemon_spans_received_total" and received.value > 0
    # Prometheus conventions: unit words and _total on counters.
    assert "plait_rank_step_duration_seconds" in families
    assert "plait_rank_mfu_ratio" in families and "plait_rank_mfu" not in families


def test_a_daemon_can_forward_to_another_daemon() -> None:
    """Node daemons upstream of a central one: the central daemon sees every node's ranks."""
    with DaemonServer("127.0.0.1:0", host_interval=0.2) as central:
        node = DaemonServer(
            "127.0.0.1:0", host_interval=0.2, otlp_endpoint=f"http://{central.address}"
        ).start()
        try:
            run_fake_rank(node.address, rank=1, steps=2, backend=FakeBackend())
        finally:
            node.stop(grace=0.5)  # flushes the forwarding queue
        with grpc.insecure_channel(central.address) as channel:
            ranks = daemon_pb2_grpc.DaemonStub(channel).ListRanks(daemon_pb2.ListRanksRequest())
        assert [(r.job_id, r.rank, r.steps_received) for r in ranks.ranks] == [("job-a", 1, 2)]
