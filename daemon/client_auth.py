"""How a client (a rank or the CLI) authenticates to a node daemon: TLS roots, a client
certificate for mutual TLS, and a bearer token, read from the environment.

A daemon bound beyond loopback requires TLS and a token (`plait.daemon.security`); clients read
them from `$PLAIT_DAEMON_TOKEN` and `$PLAIT_DAEMON_CA_CERT` (plus `$PLAIT_DAEMON_CLIENT_CERT` and
`$PLAIT_DAEMON_CLIENT_KEY` for mutual TLS). Plain gRPC only: no OpenTelemetry import, so the
daemon's own modules can share the variable names.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TOKEN_ENV = "PLAIT_DAEMON_TOKEN"
CA_CERT_ENV = "PLAIT_DAEMON_CA_CERT"
CLIENT_CERT_ENV = "PLAIT_DAEMON_CLIENT_CERT"
CLIENT_KEY_ENV = "PLAIT_DAEMON_CLIENT_KEY"

CONNECT_TIMEOUT_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class DaemonClientAuth:
    """How a client (rank or CLI) talks to a daemon: TLS roots, client certificate, token."""

    token: str = ""
    ca_cert: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None

    @classmethod
    def from_env(cls) -> DaemonClientAuth:
        def read(variable: str) -> bytes | None:
            path = os.environ.get(variable, "")
            return Path(path).read_bytes() if path else None

        return cls(
            token=os.environ.get(TOKEN_ENV, ""),
            ca_cert=read(CA_CERT_ENV),
            client_cert=read(CLIENT_CERT_ENV),
            client_key=read(CLIENT_KEY_ENV),
        )

    @property
    def tls(self) -> bool:
        return self.ca_cert is not None

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_cert,
            private_key=self.client_key,
            certificate_chain=self.client_cert,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to `address` that sends the token with every call."""
        credentials = self.credentials()
        if credentials is None:
            channel = grpc.insecure_channel(address, options=list(options))
        else:
            channel = grpc.secure_channel(address, credentials, options=list(options))
        if self.token:
            channel = grpc.intercept_channel(channel, _TokenClientInterceptor(self.metadata()))
        return channel


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _with_token(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), *self._metadata])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)


def daemon_reachable(
    address: str,
    timeout: float = CONNECT_TIMEOUT_SECONDS,
    auth: DaemonClientAuth | None = None,
) -> bool:
    """True when a gRPC server accepts a connection at `address` within `timeout` seconds."""
    channel = (auth or DaemonClientAuth()).channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()
