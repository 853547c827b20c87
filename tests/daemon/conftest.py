"""Fixtures for daemon tests: a daemon on a free loopback port and a client stub for it."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2_grpc


@pytest.fixture
def daemon_server() -> Iterator[DaemonServer]:
    server = DaemonServer("127.0.0.1:0", host_interval=0.2).start()
    try:
        yield server
    finally:
        server.stop(grace=0.5)


@pytest.fixture
def daemon_stub(daemon_server: DaemonServer) -> Iterator[daemon_pb2_grpc.DaemonStub]:
    channel = grpc.insecure_channel(daemon_server.address)
    try:
        yield daemon_pb2_grpc.DaemonStub(channel)
    finally:
        channel.close()
