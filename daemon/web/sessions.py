"""Who may see the page: the daemon's bearer token, exchanged once for a session cookie.

A daemon with a token (`--token-file`, `$PLAIT_DAEMON_TOKEN`) asks for it on a login form that
POSTs it in the request body; the answer sets an HttpOnly, SameSite=Strict cookie (Secure under
TLS) holding a random session id. The token is never in a URL, so never in a browser's history,
a proxy's log or this server's access log. Scripts may send `Authorization: Bearer <token>`
instead, as gRPC clients do. Without a token (loopback, or `--insecure`) every request passes.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from http.cookies import CookieError, SimpleCookie

COOKIE = "plait_session"
SESSION_SECONDS = 12 * 3600.0


class WebSessions:
    def __init__(self, token: str, *, secure: bool) -> None:
        self._expected = f"Bearer {token}".encode() if token else b""
        self._token = token.encode()
        self.secure = secure
        self._sessions: dict[str, float] = {}  # session id -> expiry (monotonic)
        self._lock = threading.Lock()

    @property
    def required(self) -> bool:
        return bool(self._expected)

    def login(self, given: str) -> str | None:
        """A new session id when `given` is the token, else None."""
        if not self.required or not hmac.compare_digest(given.encode(), self._token):
            return None
        session = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            # Forget expired sessions here, so the table cannot grow without bound.
            self._sessions = {s: e for s, e in self._sessions.items() if e > now}
            self._sessions[session] = now + SESSION_SECONDS
        return session

    def cookie(self, session: str) -> str:
        """The Set-Cookie value for `session`."""
        secure = "; Secure" if self.secure else ""
        return f"{COOKIE}={session}; HttpOnly; SameSite=Strict; Path=/{secure}"

    def allowed(self, cookie_header: str | None, authorization: str | None) -> bool:
        if not self.required:
            return True
        if authorization is not None and hmac.compare_digest(
            authorization.encode(), self._expected
        ):
            return True
        session = _session_of(cookie_header)
        if session is None:
            return False
        with self._lock:
            expiry = self._sessions.get(session)
        return expiry is not None and expiry > time.monotonic()


def _session_of(cookie_header: str | None) -> str | None:
    if not cookie_header:
        return None
    try:
        jar = SimpleCookie(cookie_header)
    except CookieError:
        return None
    morsel = jar.get(COOKIE)
    return morsel.value if morsel is not None else None
