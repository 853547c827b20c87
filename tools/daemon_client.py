"""Reaching the node daemons: addresses, authenticated channels, one call on every host."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

import grpc
import typer

from plait.daemon.address import resolve_daemon_address
from plait.daemon.client_auth import DaemonClientAuth
from plait.daemon.job_reports import error_text
from plait.proto.plait.v1 import daemon_pb2_grpc

Hosts = Annotated[
    list[str] | None,
    typer.Option(
        "--host", help="daemon address host:port (repeat for several nodes); default $PLAIT_DAEMON"
    ),
]
Json = Annotated[bool, typer.Option("--json", help="print machine-readable JSON instead")]
RPC_TIMEOUT_SECONDS = 10.0
MAX_CONCURRENT_HOSTS = 64  # daemons asked at once when addressed directly

Result = TypeVar("Result")
__all__ = ["Hosts", "Json", "call_all", "call_each", "error_text", "open_stub", "resolve_hosts"]


def resolve_hosts(hosts: Sequence[str] | None) -> list[str]:
    return list(hosts) if hosts else [resolve_daemon_address()]


def open_stub(host: str) -> tuple[grpc.Channel, daemon_pb2_grpc.DaemonStub]:
    channel = DaemonClientAuth.from_env().channel(host)
    return channel, daemon_pb2_grpc.DaemonStub(channel)


def call_all(
    hosts: list[str],
    call: Callable[[Any], Result],
    stub: Callable[[grpc.Channel], Any] = daemon_pb2_grpc.DaemonStub,
) -> dict[str, Result | grpc.RpcError]:
    """`call(stub)` on every host concurrently; a failing host maps to its `grpc.RpcError`.

    `stub` builds the stub from a channel: the `Daemon` service's by default, or another
    service the daemon serves (`control_pb2_grpc.ControlStub`)."""
    return call_each({host: call for host in hosts}, stub)


def call_each(
    calls: Mapping[str, Callable[[Any], Result]],
    stub: Callable[[grpc.Channel], Any] = daemon_pb2_grpc.DaemonStub,
) -> dict[str, Result | grpc.RpcError]:
    """`calls[host](stub)` on every host concurrently (a call of its own per host)."""

    def one(host: str) -> Result | grpc.RpcError:
        channel = DaemonClientAuth.from_env().channel(host)
        try:
            return calls[host](stub(channel))
        except grpc.RpcError as exc:
            return exc
        finally:
            channel.close()

    hosts = list(calls)
    with ThreadPoolExecutor(max_workers=min(max(len(hosts), 1), MAX_CONCURRENT_HOSTS)) as pool:
        return dict(zip(hosts, pool.map(one, hosts), strict=True))
