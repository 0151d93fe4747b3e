"""Adding the E2B compatibility layer (:mod:`sbx.api.e2b`) to the sbx API."""

from __future__ import annotations

from fastapi import FastAPI

import sbx.api.e2b.envd as envd
import sbx.api.e2b.routes as routes
from sbx.api.auth import Gate
from sbx.api.e2b.envd import ASGIApp, Receive, Scope, Send
from sbx.api.e2b.lifecycle import TimeoutKills
from sbx.api.e2b.pool import Pool
from sbx.api.e2b.tokens import load_secret
from sbx.control.service import ControlPlane

PREFIX = "/e2b"


def mount(app: FastAPI, cp: ControlPlane, gate: Gate) -> None:
    """Serve E2B's REST API under :data:`PREFIX` of ``app`` and envd's calls (requests with ``E2b-Sandbox-Id``)
    on every path of it, keys checked by ``gate``; while ``app`` runs, sandboxes created with ``autoPause: false``
    are killed at their timeout (:mod:`sbx.api.e2b.lifecycle`). Makes the access-token secret on first use
    (:func:`sbx.api.e2b.tokens.load_secret`)."""
    secret = load_secret(cp.settings.state_dir)
    ready = Pool(cp)
    app.mount(PREFIX, routes.create_app(cp, secret, gate, ready))
    app.add_middleware(Dispatch, envd=envd.Envd(cp, secret, ready))
    TimeoutKills(cp).around(app)  # sandboxes created with autoPause false are killed at their timeout


class Dispatch:
    """ASGI middleware: requests with an ``E2b-Sandbox-Id`` header, and signed ``/files`` URLs (which carry no
    header: anyone the SDK's user hands one to may open it), go to ``envd``; the rest to ``app``."""

    def __init__(self, app: ASGIApp, envd: ASGIApp):
        self.app = app
        self.envd = envd

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Dispatch one request or connection."""
        if scope["type"] == "http":
            signed = scope.get("path") == "/files" and b"signature=" in scope.get("query_string", b"")
            for name, _value in [(b"e2b-sandbox-id", b"")] if signed else scope.get("headers", ()):
                if name == b"e2b-sandbox-id":
                    await self.envd(scope, receive, send)
                    return
        await self.app(scope, receive, send)
