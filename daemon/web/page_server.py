"""The HTTP side of the page: the standard library's threading server, one thread per request.

Routes: `/` the page (or the login form), `/static/<file>` its bundled assets, `/events` the
server-sent events (`plait.daemon.web.live`), `/api/page` the current document as JSON, `POST
/api/profile`, `/api/memory`, `/api/stacks` the operator actions (`actions`), `/files/…` their
downloads. Under the daemon's TLS the socket is wrapped with its certificate (and its client CA
for mutual TLS); under its token every route but the login form needs a session
(`sessions`). POSTs also need the `X-Plait` header, which a cross-site form cannot send.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from plait.daemon.security import SecurityConfig
from plait.daemon.web.actions import Actions
from plait.daemon.web.live import Publisher
from plait.daemon.web.sessions import WebSessions

logger = logging.getLogger(__name__)

STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".LICENSE": "text/plain; charset=utf-8",
}
MAX_FORM_BYTES = 4096
HANDSHAKE_TIMEOUT_SECONDS = 10.0
LOGIN_FORM = """<!doctype html><html><head><meta charset="utf-8"><title>plait daemon</title>
<link rel="stylesheet" href="static/page.css"></head><body class="login">
<form method="post" action="login"><h1>plait daemon</h1>
<p>This daemon requires its token.{error}</p>
<input type="password" name="token" autocomplete="current-password" autofocus
 placeholder="token" aria-label="token"><button type="submit">open</button></form></body></html>
"""
# The page's own origin only: no inline script, nothing loaded from elsewhere.
SECURITY_HEADERS = (
    ("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
)


def static_file(name: str) -> bytes | None:
    """A bundled asset by its file name (never a path: no `/` or `..` reaches the disk)."""
    if "/" in name or name.startswith("."):
        return None
    item = resources.files("plait.daemon.web").joinpath("static", name)
    return item.read_bytes() if item.is_file() else None


class PageServer(ThreadingHTTPServer):
    daemon_threads = True  # an open event stream never holds the daemon's exit

    def __init__(
        self,
        bind: str,
        *,
        publisher: Publisher,
        actions: Actions,
        security: SecurityConfig,
    ) -> None:
        host, _, port = bind.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, int(port)), PageHandler)
        self.publisher = publisher
        self.actions = actions
        self.sessions = WebSessions(security.token, secure=security.tls)
        self.tls = security.tls
        self._tls_context: ssl.SSLContext | None = None
        if security.tls:
            assert security.tls_cert is not None and security.tls_key is not None
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(security.tls_cert), str(security.tls_key))
            if security.client_ca is not None:
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(str(security.client_ca))
            self._tls_context = context
        self.port = self.server_address[1]
        self.address = f"{host if ':' not in host else f'[{host}]'}:{self.port}"
        self._thread = threading.Thread(
            target=self.serve_forever, name="plait-web", kwargs={"poll_interval": 0.2}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}/"

    def start(self) -> None:
        self._thread.start()

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The TLS handshake happens here, in the request's own thread: a client that never
        # completes it holds that thread only, not the accept loop.
        if self._tls_context is not None:
            request.settimeout(HANDSHAKE_TIMEOUT_SECONDS)
            try:
                request = self._tls_context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                logger.debug("web: TLS handshake with %s failed: %s", client_address[0], exc)
                return
            request.settimeout(None)
        super().finish_request(request, client_address)

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits for a loop that must have started
            self.shutdown()
        self.server_close()


class PageHandler(BaseHTTPRequestHandler):
    server: PageServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        # Paths only (no query carries a secret, by design), at debug: the daemon's log stays
        # about training.
        logger.debug("web %s " + format, self.client_address[0], *args)

    # -- dispatch -------------------------------------------------------------------------------

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path = url.path
        if path.startswith("/static/"):
            return self._static(path.removeprefix("/static/"))
        if path == "/login":
            return self._login_form("")
        if not self._allowed():
            if path == "/":
                return self._login_form("")
            return self._send(HTTPStatus.UNAUTHORIZED, b"log in first\n", "text/plain")
        if path == "/":
            return self._static("index.html")
        if path == "/events":
            return self._events()
        if path == "/api/page":
            document = self.server.publisher.wait_for_document(timeout=5.0)
            return self._json(document or {})
        if path.startswith("/files/"):
            return self._download(path.removeprefix("/files/"))
        self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        form = self._form()
        if form is None:
            self.close_connection = True  # its unread body must not be taken for a request
            return self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, b"too large\n", "text/plain")
        if path == "/login":
            return self._login(form.get("token", ""))
        if not self._allowed():
            return self._send(HTTPStatus.UNAUTHORIZED, b"log in first\n", "text/plain")
        if self.headers.get("X-Plait") != "1":
            return self._send(HTTPStatus.FORBIDDEN, b"missing X-Plait header\n", "text/plain")
        actions = self.server.actions
        job = form.get("job", "")
        if not job:
            return self._send(HTTPStatus.BAD_REQUEST, b"job is required\n", "text/plain")
        try:
            if path == "/api/profile":
                return self._json(actions.profile(job, int(form.get("steps", "2"))))
            if path == "/api/memory":
                return self._json(actions.memory(job))
            if path == "/api/stacks":
                ranks = [int(r) for r in form.get("ranks", "").split(",") if r.strip()]
                return self._json(actions.stacks(job, ranks))
        except ValueError as exc:
            return self._send(HTTPStatus.BAD_REQUEST, f"{exc}\n".encode(), "text/plain")
        self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    # -- pieces ---------------------------------------------------------------------------------

    def _allowed(self) -> bool:
        return self.server.sessions.allowed(
            self.headers.get("Cookie"), self.headers.get("Authorization")
        )

    def _form(self) -> dict[str, str] | None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_FORM_BYTES:
            return None
        body = self.rfile.read(length).decode("utf-8", "replace") if length else ""
        return {k: v[-1] for k, v in parse_qs(body).items()}

    def _login_form(self, error: str) -> None:
        if not self.server.sessions.required:
            return self._redirect("/")
        page = LOGIN_FORM.format(error=f" <b>{error}</b>" if error else "")
        self._send(HTTPStatus.OK, page.encode(), STATIC_TYPES[".html"])

    def _login(self, token: str) -> None:
        session = self.server.sessions.login(token)
        if session is None:
            return self._login_form("That is not the daemon's token.")
        self._redirect("/", cookie=self.server.sessions.cookie(session))

    def _redirect(self, location: str, cookie: str | None = None) -> None:
        self.send_response(HTTPStatus.SEE_OTHER)
        self.send_header("Location", location)
        if cookie is not None:
            self.send_header("Set-Cookie", cookie)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _static(self, name: str) -> None:
        data = static_file(name)
        if data is None:
            return self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
        suffix = "." + name.rsplit(".", 1)[-1]
        self._send(HTTPStatus.OK, data, STATIC_TYPES.get(suffix, "application/octet-stream"))

    def _download(self, rest: str) -> None:
        capture, _, name = rest.partition("/")
        path = self.server.actions.captures.file(capture, name)
        if path is None:
            return self._send(HTTPStatus.NOT_FOUND, b"no such file\n", "text/plain")
        self._send(
            HTTPStatus.OK,
            path.read_bytes(),
            "application/octet-stream",
            (("Content-Disposition", f'attachment; filename="{name}"'),),
        )

    def _json(self, document: dict[str, Any]) -> None:
        body = json.dumps(document, allow_nan=False).encode()
        self._send(HTTPStatus.OK, body, "application/json")

    def _send(
        self,
        status: HTTPStatus,
        body: bytes,
        content_type: str,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (*SECURITY_HEADERS, *extra):
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _events(self) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")  # the stream ends the connection
        self.end_headers()
        self.close_connection = True
        try:
            for event in self.server.publisher.stream():
                self.wfile.write(event)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the page was closed
