"""Daemon security: where it may listen, TLS, bearer tokens, and calls it refuses cleanly.

* **Loopback by default.** Binding any other address requires TLS (server certificate and key;
  a client CA turns on mutual TLS) *and* a bearer token, unless `insecure` is set explicitly
  (`plait daemon --insecure`): a daemon's spans name hosts, ranks and the model, and its
  receivers accept writes.
* **A token on every call.** `CallGuard`, a gRPC server interceptor, checks
  `authorization: Bearer <token>` (constant-time) on every method — receivers, queries,
  health and reflection alike — and answers UNAUTHENTICATED otherwise.
* **Malformed requests** (bytes that are not the method's protobuf) get INVALID_ARGUMENT
  instead of gRPC's generic INTERNAL. **Oversized** ones (over `max_request_bytes`) get
  INVALID_ARGUMENT too, checked on the raw bytes before parsing: gRPC's own size limit answers
  RESOURCE_EXHAUSTED, which the stock OTLP exporters retry although a request that is too large
  never fits (the OTLP specification makes RESOURCE_EXHAUSTED without RetryInfo permanent, and
  INVALID_ARGUMENT is permanent for every exporter). gRPC's transport limit is kept
  `OVERSIZE_HEADROOM` times higher, so only requests beyond that still meet gRPC's own answer;
  long-lived calls (streams, trace captures) are capped so they cannot
  take every worker thread from the receivers. Refused calls are counted (`Status`).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from plait.daemon.client_auth import TOKEN_ENV, DaemonClientAuth

AUTHORIZATION = "authorization"
# The transport accepts this many times `max_request_bytes`, so the guard (not gRPC) answers for
# requests between the two; memory for one request stays bounded by the larger figure.
OVERSIZE_HEADROOM = 4
LONG_LIVED_METHODS = frozenset(
    {
        "/plait.v1.Daemon/StreamMetrics",
        "/plait.v1.Daemon/CaptureTrace",
        # Holds its thread while the job's other daemons answer (up to its deadline).
        "/plait.v1.Daemon/AskJob",
        "/plait.v1.Control/PrepareProfile",
        "/plait.v1.Control/CollectProfile",
        "/plait.v1.Control/Stacks",
        "/plait.v1.Control/Memory",
        "/grpc.health.v1.Health/Watch",
    }
)


class SecurityError(ValueError):
    """The daemon's security settings do not allow what was asked."""


def bind_host(bind: str) -> str:
    """The host part of "host:port", "[v6]:port" or "host"."""
    if bind.startswith("["):
        return bind[1 : bind.index("]")]
    return bind.rsplit(":", 1)[0] if bind.count(":") == 1 else bind


def is_loopback(bind: str) -> bool:
    host = bind_host(bind)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """TLS material (PEM file paths), the token, and the explicit opt-out."""

    tls_cert: Path | None = None
    tls_key: Path | None = None
    client_ca: Path | None = None
    token: str = ""
    insecure: bool = False

    @classmethod
    def create(
        cls,
        *,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        client_ca: str | Path | None = None,
        token: str = "",
        token_file: str | Path | None = None,
        insecure: bool = False,
    ) -> SecurityConfig:
        """From CLI options; the token comes from `token`, `token_file` or `$PLAIT_DAEMON_TOKEN`."""
        if token_file:
            token = Path(token_file).read_text().strip()
        token = token or os.environ.get(TOKEN_ENV, "")
        if bool(tls_cert) != bool(tls_key):
            raise SecurityError("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")
        if client_ca and not tls_cert:
            raise SecurityError("a client CA (mutual TLS) needs a server certificate and key")
        return cls(
            tls_cert=Path(tls_cert) if tls_cert else None,
            tls_key=Path(tls_key) if tls_key else None,
            client_ca=Path(client_ca) if client_ca else None,
            token=token,
            insecure=insecure,
        )

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def check_bind(self, bind: str) -> None:
        """Refuse a non-loopback bind without TLS and a token (unless `insecure`)."""
        if is_loopback(bind) or self.insecure:
            return
        missing = [
            what
            for what, present in (
                ("TLS (--tls-cert and --tls-key)", self.tls),
                (f"a bearer token (--token-file or ${TOKEN_ENV})", bool(self.token)),
            )
            if not present
        ]
        if missing:
            raise SecurityError(
                f"binding {bind!r} (not loopback) requires {' and '.join(missing)}; "
                "pass --insecure to listen without them on a trusted network"
            )

    def peer_auth(self) -> DaemonClientAuth:
        """How this daemon calls the other daemons of a job: a fleet shares one token and one
        trust root. The client variables (`$PLAIT_DAEMON_TOKEN`, `$PLAIT_DAEMON_CA_CERT`, ...)
        win where set; else this daemon's own token, its certificate as the root it trusts
        (a fleet certificate, or one signed by the CA it names) and, under mutual TLS, its
        certificate and key as the client's."""
        from_env = DaemonClientAuth.from_env()
        mutual = self.client_ca is not None and self.tls_cert and self.tls_key
        return DaemonClientAuth(
            token=from_env.token or self.token,
            ca_cert=from_env.ca_cert
            or (self.tls_cert.read_bytes() if self.tls_cert is not None else None),
            client_cert=from_env.client_cert
            or (self.tls_cert.read_bytes() if mutual and self.tls_cert else None),
            client_key=from_env.client_key
            or (self.tls_key.read_bytes() if mutual and self.tls_key else None),
        )

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        assert self.tls_cert is not None and self.tls_key is not None
        root = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(self.tls_key.read_bytes(), self.tls_cert.read_bytes())],
            root_certificates=root,
            require_client_auth=root is not None,
        )


@dataclass
class CallCounters:
    """Calls the guard refused, by reason."""

    unauthenticated: int = 0
    malformed: int = 0
    oversize: int = 0
    over_limit: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, reason: str) -> None:
        with self.lock:
            setattr(self, reason, getattr(self, reason) + 1)

    @property
    def total(self) -> int:
        return self.unauthenticated + self.malformed + self.oversize + self.over_limit

    def by_reason(self) -> dict[str, int]:
        with self.lock:
            reasons = {
                "unauthenticated": self.unauthenticated,
                "malformed": self.malformed,
                "oversize": self.oversize,
                "over_limit": self.over_limit,
            }
        return {reason: count for reason, count in reasons.items() if count}


class _Malformed:
    __slots__ = ("error", "reason")

    def __init__(self, error: str, reason: str = "malformed") -> None:
        self.error = error
        self.reason = reason


def _refusing_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts (request bytes unparsed)."""

    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, details)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class CallGuard(grpc.ServerInterceptor):
    """Token check, malformed-request status and the long-lived-call cap, for every method."""

    def __init__(
        self,
        token: str = "",
        *,
        max_long_lived: int = 32,
        counters: CallCounters | None = None,
        max_request_bytes: int | None = None,
    ) -> None:
        self._expected = f"Bearer {token}".encode() if token else b""
        self._long_lived = threading.BoundedSemaphore(max_long_lived)
        self.max_long_lived = max_long_lived
        self.counters = counters or CallCounters()
        self.max_request_bytes = max_request_bytes

    def _authorized(self, metadata: Any) -> bool:
        if not self._expected:
            return True
        for key, value in metadata or ():
            if key == AUTHORIZATION:
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)
        return False

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED from gRPC itself
        if not self._authorized(handler_call_details.invocation_metadata):
            self.counters.count("unauthenticated")
            return _refusing_handler(
                handler, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"
            )
        if handler.request_streaming:
            return handler
        return self._guarded(handler, handler_call_details.method)

    def _guarded(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer
        counters = self.counters

        max_bytes = self.max_request_bytes

        def parse(data: bytes) -> Any:
            if max_bytes is not None and len(data) > max_bytes:
                return _Malformed(
                    f"request of {len(data)} bytes is over the daemon's limit of {max_bytes} "
                    "bytes; send smaller batches",
                    reason="oversize",
                )
            if deserialize is None:
                return data
            try:
                return deserialize(data)
            except (DecodeError, ValueError, TypeError, RuntimeError) as exc:
                return _Malformed(f"{type(exc).__name__}: {exc}")

        limit = self._long_lived if method in LONG_LIVED_METHODS else None
        behaviour = handler.unary_stream if handler.response_streaming else handler.unary_unary

        def check(request: Any, context: grpc.ServicerContext) -> None:
            if isinstance(request, _Malformed):
                counters.count(request.reason)
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{request.reason} request: {request.error}"
                )

        def admit(context: grpc.ServicerContext) -> None:
            if limit is not None and not limit.acquire(blocking=False):
                counters.count("over_limit")
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"at most {self.max_long_lived} streams and trace captures at once",
                )

        if handler.response_streaming:

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Any:
                check(request, context)
                admit(context)
                try:
                    yield from behaviour(request, context)
                finally:
                    if limit is not None:
                        limit.release()

            return handler._replace(request_deserializer=parse, unary_stream=unary_stream)

        def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
            check(request, context)
            admit(context)
            try:
                return behaviour(request, context)
            finally:
                if limit is not None:
                    limit.release()

        return handler._replace(request_deserializer=parse, unary_unary=unary_unary)
