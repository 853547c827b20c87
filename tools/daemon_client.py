"""Reaching the node daemons: addresses, authenticated channels, one call on every host."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, TypeVar

import grpc
import typer

from plait.core.daemon_address import resolve_daemon_address
from plait.core.daemon_auth import DaemonClientAuth
from plait.proto.plait.v1 import daemon_pb2_grpc

Hosts = Annotated[
    list[str] | None,
    typer.Option(
        "--host", help="daemon address host:port (repeat for several nodes); default $PLAIT_DAEMON"
    ),
]
Json = Annotated[bool, typer.Option("--json", help="print machine-readable JSON instead")]
RPC_TIMEOUT_SECONDS = 10.0

Result = TypeVar("Result")


def resolve_hosts(hosts: Sequence[str] | None) -> list[str]:
    return list(hosts) if hosts else [resolve_daemon_address()]


def open_stub(host: str) -> tuple[grpc.Channel, daemon_pb2_grpc.DaemonStub]:
    channel = DaemonClientAuth.from_env().channel(host)
    return channel, daemon_pb2_grpc.DaemonStub(channel)


def call_all(
    hosts: list[str], call: Callable[[daemon_pb2_grpc.DaemonStub], Result]
) -> dict[str, Result | grpc.RpcError]:
    """`call(stub)` on every host concurrently; a failing host maps to its `grpc.RpcError`."""

    def one(host: str) -> Result | grpc.RpcError:
        channel, stub = open_stub(host)
        try:
            return call(stub)
        except grpc.RpcError as exc:
            return exc
        finally:
            channel.close()

    with ThreadPoolExecutor(max_workers=max(len(hosts), 1)) as pool:
        return dict(zip(hosts, pool.map(one, hosts), strict=True))


def error_text(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code else 'ERROR'}: {details}"
