"""The web page's HTTP side without a browser: the daemon's token and TLS rules, the token never
in a URL or a log line, the event stream pushing each document in order, refusals at the door."""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from plait.daemon.security import SecurityConfig, SecurityError
from plait.daemon.server import DaemonServer
from plait.daemon.web.history import MfuHistory
from plait.daemon.web.live import Publisher
from tests.daemon.certs import TestPki, make_pki

TOKEN = "s3cret-daemon-token"


def request(
    server: DaemonServer,
    method: str,
    path: str,
    body: str = "",
    headers: dict[str, str] | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], bytes]:
    assert server.web is not None
    host, port = server.web.server.address.rsplit(":", 1)
    connection = (
        http.client.HTTPSConnection(host, int(port), timeout=10, context=context)
        if context is not None
        else http.client.HTTPConnection(host, int(port), timeout=10)
    )
    try:
        sent = {"Content-Type": "application/x-www-form-urlencoded", **(headers or {})}
        connection.request(method, path, body=body.encode(), headers=sent)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


@pytest.fixture
def token_daemon() -> Iterator[DaemonServer]:
    server = DaemonServer(
        "127.0.0.1:0", web="127.0.0.1:0", web_interval=0.1, security=SecurityConfig(token=TOKEN)
    ).start()
    try:
        yield server
    finally:
        server.stop(grace=0.5)


def test_token_is_asked_once_on_a_form_and_kept_in_a_session_cookie(
    token_daemon: DaemonServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="plait.daemon.web")
    status, _, body = request(token_daemon, "GET", "/")
    assert status == 200 and b'name="token"' in body and b"page.js" not in body
    for path in ("/api/page", "/events", "/files/x/y"):
        assert request(token_daemon, "GET", path)[0] == 401, path
    status, headers, body = request(token_daemon, "POST", "/login", "token=wrong")
    assert status == 200 and "Set-Cookie" not in headers and b"not the daemon's token" in body

    status, headers, _ = request(token_daemon, "POST", "/login", f"token={TOKEN}")
    assert status == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    session = {"Cookie": cookie.split(";", 1)[0]}
    status, _, body = request(token_daemon, "GET", "/", headers=session)
    assert status == 200 and b"page.js" in body
    status, _, body = request(token_daemon, "GET", "/api/page", headers=session)
    assert status == 200 and json.loads(body)["top"]["jobs"] == []
    # Scripts send the token as gRPC clients do; a wrong one is refused.
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert request(token_daemon, "GET", "/api/page", headers=bearer)[0] == 200
    assert (
        request(token_daemon, "GET", "/api/page", headers={"Authorization": "Bearer x"})[0] == 401
    )
    # A cross-site form cannot set the header the actions need.
    assert request(token_daemon, "POST", "/api/stacks", "job=a", headers=session)[0] == 403
    # Nothing logged (paths, the login's body) holds the token.
    assert caplog.records and all(TOKEN not in r.getMessage() for r in caplog.records)


def test_assets_are_bundled_and_no_path_leaves_them(token_daemon: DaemonServer) -> None:
    status, headers, body = request(token_daemon, "GET", "/static/uPlot.iife.min.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert b"uPlot" in body and len(body) > 30_000
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for path in ("/static/../page_data.py", "/static/%2e%2e/page_data.py", "/static/.hidden"):
        assert request(token_daemon, "GET", path)[0] == 404, path


def test_page_needs_the_daemons_tls_and_refuses_an_open_public_bind(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="requires TLS"):
        DaemonServer("127.0.0.1:0", web="0.0.0.0:0")
    pki: TestPki = make_pki(tmp_path)
    security = SecurityConfig(tls_cert=pki.server_cert, tls_key=pki.server_key, token=TOKEN)
    server = DaemonServer("127.0.0.1:0", web="127.0.0.1:0", security=security).start()
    try:
        assert server.web is not None and server.web.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(pki.ca))
        status, headers, _ = request(server, "POST", "/login", f"token={TOKEN}", context=context)
        assert status == 303 and "; Secure" in headers["Set-Cookie"]
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            request(server, "GET", "/")  # plain HTTP to the TLS port gets nothing
    finally:
        server.stop(grace=0.5)


def test_each_document_is_pushed_to_every_page_in_order() -> None:
    documents = iter(range(1000))

    def compute() -> dict:
        n = next(documents)
        return {"top": {"jobs": [{"job_id": "j", "mfu": n / 1000}], "ranks": []},
                "computed_unix_nano": n * 10**9}  # fmt: skip

    # A long interval: the test publishes by hand, so what is pushed is known.
    publisher = Publisher(compute, interval=3600, history=MfuHistory(capacity=3))
    publisher.publish(compute())
    streams = [publisher.stream() for _ in range(2)]
    for stream in streams:
        assert next(stream).startswith(b"event: history\n")
        assert b'"sequence":1' in next(stream)  # the latest document first
    received: list[list[bytes]] = [[], []]

    def read(i: int) -> None:
        for event in streams[i]:
            received[i].append(event)
            if len(received[i]) == 3:
                return

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for reader in readers:
        reader.start()
    for _ in range(3):
        publisher.publish(compute())
    for reader in readers:
        reader.join(timeout=10)
        assert not reader.is_alive()
    for events in received:
        sequences = [json.loads(e.split(b"data: ", 1)[1])["document"]["sequence"] for e in events]
        assert sequences == [2, 3, 4]
    # The history keeps the newest samples, the MFU of the documents pushed.
    assert [s["jobs"]["j"] for s in publisher.history.samples()] == [0.001, 0.002, 0.003]
    publisher.stop()
    assert list(publisher.stream())[-1].startswith(b"event: snapshot")  # then the stream ends
