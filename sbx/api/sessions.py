"""The web console's sessions and CSRF rules (the key check itself is :class:`sbx.api.auth.Gate`'s).

Signing in with an API key opens a server-side session (a random id, kept in memory with the key it was opened
with, that key's id and an expiry); the browser holds only the id, in the HttpOnly, ``SameSite=Strict`` cookie
:data:`SESSION_COOKIE`. Every request made with the cookie checks the session's key again through the same
:meth:`sbx.api.auth.Gate.check` a bearer request gets (rate limit included), so a revoked or expired key ends its
sessions. CSRF: a cookie-only request that is not ``GET``/``HEAD`` must carry the session's CSRF token in the
:data:`CSRF_HEADER` header (a cross-site form cannot set a header, and no CORS is answered, so a foreign page cannot
read the token), and a WebSocket opened with the cookie must come from the server's own origin and carry the token
as ``?csrf=`` (:func:`csrf_ok`). Sessions live in this server process: a restart signs everyone out.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from sbx.control.errors import ControlError

SESSION_COOKIE = "sbx_console"
"""Name of the console's session cookie (the hosted-port proxy strips it and never accepts it)."""
CSRF_HEADER = "x-sbx-csrf"
"""Header a cookie-only request that changes something must carry: the session's CSRF token."""
SESSION_SECONDS = 12 * 3600
"""How long a console session lasts after sign-in, in seconds."""
MAX_SESSIONS = 10_000
"""Most sessions kept at once; opening one more drops the oldest."""
_SAFE = {"GET", "HEAD", "OPTIONS"}


@dataclass
class Session:
    """One signed-in console: the ``key`` (API token) it was opened with and that key's ``key_id``, its ``csrf``
    token, ``expires`` (``time.time()`` seconds)."""

    id: str
    key: str
    key_id: str
    csrf: str
    expires: float


class Sessions:
    """Console sessions of this server process, by random id (thread-safe). ``clock``: wall-clock seconds."""

    def __init__(self, seconds: float = SESSION_SECONDS, clock: Callable[[], float] = time.time):
        self.seconds = seconds
        self._clock = clock
        self._by_id: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, key: str, key_id: str) -> Session:
        """A new session for ``key`` (already checked by the caller; its id ``key_id``), lasting :attr:`seconds`."""
        s = Session(secrets.token_urlsafe(32), key, key_id, secrets.token_urlsafe(24), self._clock() + self.seconds)
        with self._lock:
            now = self._clock()
            for sid in [k for k, v in self._by_id.items() if v.expires <= now]:
                del self._by_id[sid]
            while len(self._by_id) >= MAX_SESSIONS:
                del self._by_id[next(iter(self._by_id))]
            self._by_id[s.id] = s
        return s

    def get(self, sid: str | None) -> Session | None:
        """The live session with id ``sid``, or None (unknown or expired; an expired one is dropped)."""
        if not sid:
            return None
        with self._lock:
            s = self._by_id.get(sid)
            if s is not None and s.expires <= self._clock():
                del self._by_id[sid]
                return None
            return s

    def close(self, sid: str | None) -> None:
        """End session ``sid`` (nothing when unknown)."""
        with self._lock:
            self._by_id.pop(sid or "", None)


def same_origin(origin: str | None, host: str | None) -> bool:
    """Whether an ``Origin`` header names the host (``host:port``) the request was sent to."""
    if not origin or not host:
        return False
    return urlsplit(origin).netloc.lower() == host.lower()


def csrf_ok(session: Session, method: str, headers: Mapping[str, str], query: Mapping[str, str] | None = None,
            websocket: bool = False) -> None:
    """The CSRF rules of a cookie-only request (see the module text); raises ``403 csrf_failed``."""
    if websocket:
        ok = same_origin(headers.get("origin"), headers.get("host")) and _equal((query or {}).get("csrf"),
                                                                             session.csrf)
    else:
        ok = method.upper() in _SAFE or _equal(headers.get(CSRF_HEADER), session.csrf)
    if not ok:
        raise ControlError("csrf_failed", "a console request that changes something must carry the session's "
                           f"{CSRF_HEADER} header (and a terminal must be opened from the console's own page)", 403)


def _equal(a: str | None, b: str) -> bool:
    return bool(a) and secrets.compare_digest((a or "").encode(), b.encode())
