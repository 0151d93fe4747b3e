"""The web console, served by ``sbx server`` itself: the page at ``/``, its files under ``/console/``, and the
sign-in routes. Pages, scripts and styles are in ``static/`` (written here); the libraries they use (xterm.js, its
fit add-on, uPlot) are installed from the npm registry by ``scripts/build-console.sh`` (``scripts/install.sh``
runs it) into ``static/vendor/``, which git ignores. Nothing is loaded from another host at run time::

    GET    /                        the console page (HTML; not in the OpenAPI document)
    GET    /console/...             its scripts, styles and libraries
    POST   /v1/console/session      sign in {"key"}     200 {"session": {"keyId","csrf","expiresAt"}} + cookie
    GET    /v1/console/session      the current session 200 {"session"} / 401 unauthorized
    DELETE /v1/console/session      sign out            200 {"signedOut": true}, cookie cleared

Sign-in checks the key with :meth:`sbx.api.auth.Gate.check` (the check bearer requests get, with its rate limit
and wrong-key throttle) and answers a wrong key with the API's ``401 unauthorized``; a sign-in posted from another
origin is ``403 csrf_failed``. The session then acts as that key's :class:`~sbx.control.accounts.keys.Principal`:
the same account, the same ownership checks (another account's sandbox is 404), and the key is checked again on
every request. The page sends the session's ``csrf`` in ``X-Sbx-Csrf`` with every change; see
:mod:`sbx.api.sessions` for the rules.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from sbx.api import schemas as S
from sbx.api import schemas_accounts as SA
from sbx.api.auth import Gate, client_address
from sbx.api.models import SignIn
from sbx.api.sessions import SESSION_COOKIE, Session, same_origin
from sbx.control.accounts.keys import Principal
from sbx.control.errors import ControlError

STATIC = Path(__file__).parent / "static"
"""The console's own files (``index.html``, ``app.js``, ``pages/``, ``console.css``) and ``vendor/``."""
VENDOR_FILES = ("xterm.js", "xterm.css", "addon-fit.js", "uPlot.js", "uPlot.css")
"""What ``scripts/build-console.sh`` puts in ``static/vendor``."""

CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self' ws: wss:; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
"""The page's Content-Security-Policy: its own scripts only (xterm.js sets inline styles), no framing."""

_MISSING = """<!doctype html><meta charset="utf-8"><title>sbx console</title>
<p>The web console's libraries are not built: run <code>scripts/install.sh</code> (or
<code>scripts/build-console.sh</code>) in the sbx checkout, then reload.</p>"""


def assets_built() -> bool:
    """Whether every library the console needs is in ``static/vendor``."""
    return all((STATIC / "vendor" / name).is_file() for name in VENDOR_FILES)


def _session_view(s: Session, who: Principal) -> dict[str, Any]:
    return {"session": {"keyId": who.key_id, "account": who.account_id, "admin": who.admin, "csrf": s.csrf,
                        "expiresAt": datetime.fromtimestamp(s.expires, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}}


def _secure(request: Request) -> bool:
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").lower() == "https"


def register(app: FastAPI) -> None:
    """Add the console page, its static files and the session routes to ``app`` (its ``state.gate`` keeps the
    sessions)."""
    gate: Gate = app.state.gate
    headers = {"Content-Security-Policy": CSP, "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
               "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}

    @app.get("/", include_in_schema=False)
    def console_page() -> Response:
        if not assets_built():
            return HTMLResponse(_MISSING, status_code=503, headers=headers)
        return HTMLResponse((STATIC / "index.html").read_text(), headers=headers)

    app.mount("/console", StaticFiles(directory=STATIC, check_dir=False), name="console")

    @app.post("/v1/console/session", tags=["console"], response_model=SA.ConsoleSessionOut,
              responses=S.errors(401, 403))
    def sign_in(body: SignIn, request: Request) -> JSONResponse:
        """Sign the web console in with an API key: answers the session and sets its HttpOnly, SameSite=Strict
        cookie (``sbx_console``). A wrong key is ``401 unauthorized``; a request from another origin ``403
        csrf_failed``."""
        origin = request.headers.get("origin")
        if origin is not None and not same_origin(origin, request.headers.get("host")):
            raise ControlError("csrf_failed", "sign in from the console's own page", 403)
        who = gate.check(body.key, client_address(request))
        gate.sessions.close(request.cookies.get(SESSION_COOKIE))
        session = gate.sessions.open(body.key, who.key_id)
        resp = JSONResponse(_session_view(session, who), headers={"Cache-Control": "no-store"})
        resp.set_cookie(SESSION_COOKIE, session.id, max_age=int(gate.sessions.seconds), path="/", httponly=True,
                        samesite="strict", secure=_secure(request))
        return resp

    @app.get("/v1/console/session", tags=["console"], response_model=SA.ConsoleSessionOut, responses=S.errors(401))
    def current_session(request: Request) -> dict[str, Any]:
        """The console session of this request's cookie (its ``csrf`` token), or ``401 unauthorized``."""
        who = gate.authorize("GET", {}, request.cookies, client_address(request))
        session = gate.sessions.get(request.cookies.get(SESSION_COOKIE))
        if session is None:  # expired between the two reads
            raise ControlError("unauthorized", "no console session", 401)
        return _session_view(session, who)

    @app.delete("/v1/console/session", tags=["console"], response_model=SA.SignedOut, responses=S.errors())
    def sign_out(request: Request) -> JSONResponse:
        """Sign out: ends the cookie's session (if any) and clears the cookie."""
        gate.sessions.close(request.cookies.get(SESSION_COOKIE))
        resp = JSONResponse({"signedOut": True})
        resp.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=_secure(request))
        return resp
