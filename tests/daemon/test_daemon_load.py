"""32 clients streaming and querying while 2 ranks export: every call succeeds."""

from __future__ import annotations

import threading

import pytest

from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2
from plait.tools.bench.daemon_load import export_like_a_rank, run_clients

CLIENTS = 32


@pytest.mark.timeout(120)
def test_concurrent_clients_while_ranks_export(daemon_server: DaemonServer, daemon_stub) -> None:
    ranks = [
        threading.Thread(target=export_like_a_rank, args=(daemon_server.address, r, 2, 4.0))
        for r in range(2)
    ]
    for rank in ranks:
        rank.start()
    result = run_clients(daemon_server.address, CLIENTS, seconds=2.0)
    for rank in ranks:
        rank.join(timeout=60)
    assert result.errors == []
    assert result.stream_messages >= CLIENTS  # every stream delivered
    for method in ("GetMetrics", "GetBottleneck", "Status"):
        assert len(result.latencies[method]) >= CLIENTS, method
    status = daemon_stub.Status(daemon_pb2.StatusRequest())
    assert status.ranks == 2 and status.spans_received > 0
    assert (status.spans_dropped, status.calls_rejected) == (0, 0)
    print(
        "query latency p50/p99 (ms): "
        + ", ".join(
            f"{m} {result.percentile(m, 0.5) * 1e3:.1f}/{result.percentile(m, 0.99) * 1e3:.1f}"
            for m in sorted(result.latencies)
        )
    )
