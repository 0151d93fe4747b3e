"""Who a request is, and whether it may go on: API keys, the request's :class:`Principal`, abuse limits.

- The installation's admin key is the token in ``<state_dir>/token`` (mode 0600; :func:`ensure_token`), made on
  the first start and written to the client config by ``sbx server``. Accounts' keys live hashed in the database
  (:mod:`sbx.control.accounts.keys`).
- :func:`principal` is the FastAPI dependency every ``/v1`` route has: it yields the request's
  :class:`~sbx.control.accounts.keys.Principal` (account id, key id, admin flag), or answers 401 ``unauthorized``
  (missing, unknown, revoked or expired key). Anything that needs the request's account (e.g. secrets of a
  credential proxy) should take ``principal: Principal = Depends(principal)``.
- :func:`owned` (a dependency of the ``/v1`` router) checks the path's ``sandbox_id`` (or a snapshot's ``name``)
  against the principal after the lookup: another account's resource answers exactly like a missing one, 404
  ``not_found``. The admin sees all.
- :class:`Gate` keeps the abuse limits in memory, per server process (or, given
  :class:`~sbx.control.accounts.limits.SharedLimits`, in the PostgreSQL database every replica shares, so N replicas
  allow each limit once in total: issue 35): a token bucket per account key
  (``Settings.rate_limit`` requests/s, ``rate_burst`` at once; over it 429 ``rate_limited`` with ``Retry-After``),
  and a count of wrong keys per client address (``auth_fail_limit`` per ``auth_fail_window`` seconds; over it
  every key that address presents is answered 401 ``auth_throttled`` with ``Retry-After`` until the window ends
  without being looked up (401, not 429: to the client it is still "not authenticated"), so guessing cannot go on
  by being right; only keys that address already used successfully before go on working, checked against that
  in-memory list alone).
- The web console's cookie sessions (:mod:`sbx.api.sessions`) are kept by the Gate too (:attr:`Gate.sessions`):
  :meth:`Gate.authorize` takes either a bearer key or a session cookie (with the console's CSRF rules), and a
  session's key goes through :meth:`Gate.check` again on every request, so there is one key check, one
  :class:`Principal` and the same ownership rules whichever way a request is signed.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from sbx.api.sessions import SESSION_COOKIE, Sessions, csrf_ok
from sbx.config import Settings
from sbx.control.accounts.keys import Accounts, Principal, digest
from sbx.control.accounts.limits import SharedLimits
from sbx.control.errors import ControlError, not_found
from sbx.control.store.database import SandboxRow

bearer = HTTPBearer(auto_error=False, description="An API key (sbx server writes the installation's admin key to "
                    "~/.config/sbx/config.toml; `sbx admin key create` makes an account's). The web console's "
                    "session cookie is accepted too.")


def token_path(settings: Settings) -> Path:
    """Where the server's API token lives: ``<settings.state_dir>/token``."""
    return settings.state_dir / "token"


def ensure_token(settings: Settings) -> str:
    """Read the server's API token, creating a random one (``sbx_`` + 43 URL-safe characters) on first use."""
    path = token_path(settings)
    if path.is_file():
        token = path.read_text().strip()
        if token:
            return token
    path.parent.mkdir(parents=True, exist_ok=True)
    token = "sbx_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


GOOD_KEYS_KEPT = 64
"""Keys remembered per client address as having worked from it (they skip the wrong-key throttle)."""


def _retry(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


class Gate:
    """Authentication and abuse limits for one server process (thread-safe). ``clock`` is monotonic seconds (the
    in-memory limits'). ``limits``: keep the token buckets and wrong-key counts there instead (every replica of a
    PostgreSQL database: :func:`sbx.control.accounts.limits.shared_limits`; its clock is the database's)."""

    def __init__(self, accounts: Accounts, settings: Settings, clock: Callable[[], float] = time.monotonic,
                 sessions: Sessions | None = None, limits: SharedLimits | None = None):
        self.accounts = accounts
        self.shared = limits
        self.sessions = sessions or Sessions()
        self.settings = settings
        self.clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens, at)
        self._fails: dict[str, deque[float]] = {}  # client address -> times of wrong keys
        self._good: dict[str, set[str]] = {}  # client address -> digests of keys that worked from it

    def check(self, token: str | None, client: str) -> Principal:
        """The principal of ``token`` presented from address ``client``. Raises 401 ``unauthorized`` (no key, or
        a wrong/revoked/expired one, or one of a deleted account), 403 ``account_suspended`` (its account is
        suspended), 401 ``auth_throttled`` (this address presented too many wrong keys lately;
        with ``Retry-After``) or 429 ``rate_limited`` (this key is over its request rate)."""
        if not token:
            raise ControlError("unauthorized", "missing API key (Authorization: Bearer <key>)", 401)
        key = digest(token)
        ticket = self._throttled(client) if key not in self._good.get(client, ()) else None
        try:
            found = self.accounts.authenticate(token)
        except BaseException:  # (a suspended account's key: not a wrong key)
            self._attempt_ok(ticket)
            raise
        if found is None:
            self._failed(client)
            raise ControlError("unauthorized", "wrong, revoked or expired API key", 401)
        self._attempt_ok(ticket)
        with self._lock:
            good = self._good.setdefault(client, set())
            if len(good) < GOOD_KEYS_KEPT:
                good.add(key)
        if not found.admin:
            self._rate(found.key_id)
        return found

    def authorize(self, method: str, headers: Mapping[str, str], cookies: Mapping[str, str], client: str,
                  query: Mapping[str, str] | None = None, websocket: bool = False) -> Principal:
        """Authorize one request from address ``client``. An ``Authorization`` header decides on its own (a wrong
        one is 401 even with a session cookie; a scheme other than ``Bearer`` counts as no key). Otherwise the
        :data:`~sbx.api.sessions.SESSION_COOKIE` must name a live session, the request must pass the CSRF rules
        (:func:`~sbx.api.sessions.csrf_ok`, else ``403 csrf_failed``) and the session's key must still pass
        :meth:`check` (a key that fails ends the session). Raises as :meth:`check` does."""
        header = headers.get("authorization")
        if header:
            scheme, _, cred = header.partition(" ")
            return self.check(cred.strip() if scheme.lower() == "bearer" else None, client)
        session = self.sessions.get(cookies.get(SESSION_COOKIE))
        if session is None:
            raise ControlError("unauthorized", "missing API key (Authorization: Bearer <key>) or console session",
                               401)
        csrf_ok(session, method, headers, query, websocket)
        try:
            found = self.check(session.key, client)
        except ControlError as e:
            if e.code == "unauthorized":
                self.sessions.close(session.id)
            raise
        if found.key_id != session.key_id:  # the same token can only name one key; kept as a guard
            self.sessions.close(session.id)
            raise ControlError("unauthorized", "wrong, revoked or expired API key", 401)
        return found

    def _throttled(self, client: str) -> int | None:
        """401 ``auth_throttled`` when ``client`` presented too many wrong keys lately. With shared limits the
        key about to be checked counts already; returns its ticket (None in memory)."""
        limit, window = self.settings.auth_fail_limit, self.settings.auth_fail_window
        if limit <= 0:
            return None
        if self.shared is not None:
            got = self.shared.attempt(client, limit, window)
            if got.wait is not None:
                raise _throttle_error(got.wait)
            return got.ticket
        now = self.clock()
        with self._lock:
            fails = self._fails.get(client)
            while fails and fails[0] <= now - window:
                fails.popleft()
            if fails is not None and not fails:
                del self._fails[client]
            if fails and len(fails) >= limit:
                raise _throttle_error(fails[0] + window - now)
        return None

    def _attempt_ok(self, ticket: int | None) -> None:
        if ticket is not None and self.shared is not None:
            self.shared.attempt_ok(ticket)

    def _failed(self, client: str) -> None:
        if self.settings.auth_fail_limit > 0 and self.shared is None:  # (shared: its attempt stays counted)
            with self._lock:
                self._fails.setdefault(client, deque()).append(self.clock())

    def _rate(self, key_id: str) -> None:
        rate, burst = self.settings.rate_limit, max(1, self.settings.rate_burst)
        if rate <= 0:
            return
        if self.shared is not None:
            wait = self.shared.take(key_id, rate, burst)
            if wait is not None:
                raise _rate_error(rate, wait)
            return
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.get(key_id, (float(burst), now))
            tokens = min(float(burst), tokens + (now - at) * rate)
            if tokens < 1.0:
                self._buckets[key_id] = (tokens, now)
                raise _rate_error(rate, (1.0 - tokens) / rate)
            self._buckets[key_id] = (tokens - 1.0, now)


def _throttle_error(wait: float) -> ControlError:
    return ControlError("auth_throttled", f"too many wrong API keys from this address; try again in "
                        f"{math.ceil(wait)} s", 401, headers=_retry(wait))


def _rate_error(rate: float, wait: float) -> ControlError:
    return ControlError("rate_limited", f"this API key is over {rate:g} requests per second; retry in "
                        f"{math.ceil(wait)} s", 429, headers=_retry(wait))


def client_address(request: Request) -> str:
    """The client's IP address (``"unknown"`` when the server does not know it)."""
    return request.client.host if request.client else "unknown"


def _authorized(request: Request) -> Principal:
    """The request's :class:`Principal` (:meth:`Gate.authorize`, once per request: the result is kept in
    ``request.state.principal``, so a route's rate limit counts the request once)."""
    found: Principal | None = getattr(request.state, "principal", None)
    if found is None:
        gate: Gate = request.app.state.gate
        found = gate.authorize(request.method, request.headers, request.cookies, client_address(request))
        request.state.principal = found
    return found


def principal(request: Request, _creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Principal:
    """FastAPI dependency: the request's :class:`Principal` from its bearer key or its console session cookie
    (:meth:`Gate.authorize`); 401/403/429 otherwise. Also left in ``request.state.principal``."""
    return _authorized(request)


def check_sandbox(control: object, who: Principal, sandbox_id: str) -> SandboxRow | None:
    """404 ``not_found`` when sandbox ``sandbox_id`` exists but belongs to an account ``who`` does not see (a
    missing one is left to the route, which answers the same). Returns the row it read (None when missing)."""
    row: SandboxRow | None = control.store.get_sandbox(sandbox_id)  # type: ignore[attr-defined]
    if row is not None and not who.sees(row.account_id):
        raise not_found(f"sandbox {sandbox_id}")
    return row


def owned(request: Request, _creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Principal:
    """Router dependency: the ownership check of every ``/v1`` route's path (``sandbox_id``; ``name`` of
    ``/v1/snapshots/{name}``, a name within the key's account), after the request's principal (as
    :func:`principal`). One function, not one depending on the other: FastAPI runs each synchronous dependency
    in a worker thread, and the hop between two was about 0.25 ms of an exec's 12 ms here."""
    who = _authorized(request)
    control = request.app.state.control
    params = request.path_params
    if "sandbox_id" in params:
        # kept for the route: an exec uses it instead of reading the row again (~0.3 ms)
        request.state.sandbox_row = check_sandbox(control, who, str(params["sandbox_id"]))
    if "name" in params and request.url.path.startswith("/v1/snapshots/"):
        control.find_snapshot(str(params["name"]), who.account_id, who.admin)  # 404 unless the key's account has it
    return who


def require_admin(who: Principal) -> None:
    """403 ``admin_only`` unless ``who`` holds the installation's admin key: for what every account shares (the
    accounts themselves, the nodes)."""
    if not who.admin:
        raise ControlError("admin_only", "this needs the installation's admin key", 403)
