"""``GET /metrics`` and request ids (issue 35).

``/metrics`` answers Prometheus' text format: the process's series (:mod:`sbx.metrics`) and the gauges computed
from the store at each scrape (:class:`sbx.control.sandboxes.observe.PlaneCollector`). Every series is an aggregate
(no sandbox id, account or key in any label), so it needs no API key; with ``SBX_METRICS_TOKEN`` set a scrape must
send ``Authorization: Bearer <that token>`` (a token that can read metrics and nothing else). Sandboxes never reach
it: the node's nftables ``input`` chain drops every connection from the bridge to the host
(:func:`sbx.node.network.ruleset.inet_ruleset`), which holds for every port of the server.

:class:`RequestIds` gives each request an id: the client's ``X-Request-Id`` when it is a short token, else a new
one; the response carries it back, and every log line written while the request is served (and by the operation
it starts, in the control plane's worker: :mod:`sbx.logs`) names it, with the sandbox of a ``/v1/sandboxes/<id>``
path.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from sbx import logs, metrics
from sbx.api.errors import error_response
from sbx.config import Settings
from sbx.control.sandboxes.observe import PlaneCollector
from sbx.control.service import ControlPlane

REQUEST_ID_HEADER = "X-Request-Id"
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_SANDBOX_PATH = re.compile(r"^/v1/sandboxes/(sb_[a-z0-9]{10})(?:/|$)")


def new_request_id() -> str:
    """A fresh request id: ``req_`` and 16 hex digits."""
    return "req_" + secrets.token_hex(8)


class RequestIds:
    """ASGI middleware: bind the request id (and the sandbox of a ``/v1/sandboxes/<id>`` path) for the request's
    log lines (:func:`sbx.logs.bound`) and answer it in ``X-Request-Id``."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Serve one HTTP or WebSocket connection with its ids bound."""
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"x-request-id"), "")
        rid = given if _CLIENT_ID.match(given) else new_request_id()
        m = _SANDBOX_PATH.match(scope.get("path", ""))

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", rid.encode("latin-1"))]}
            await send(message)

        with logs.bound(m.group(1) if m else None, rid):
            await self.app(scope, receive, send_with_id)


def register(app: FastAPI, cp: ControlPlane, settings: Settings) -> None:
    """Add ``GET /metrics`` (described in the OpenAPI document, tag ``meta``) and :class:`RequestIds` to ``app``."""
    collector = PlaneCollector(cp)

    @app.get("/metrics", tags=["meta"], response_class=Response, responses={
        200: {"description": "Prometheus text format 0.0.4: aggregate series only (see the README's operator "
                             "section)", "content": {metrics.CONTENT_TYPE: {"schema": {"type": "string"}}}},
        401: {"description": "SBX_METRICS_TOKEN is set and the request did not send it"}})
    def metrics_endpoint(request: Request) -> Response:
        """Prometheus metrics of this server: sandboxes by state, operation latencies, admission refusals, CRIU
        failures, node capacity, replication lag. Needs no API key; ``Bearer <SBX_METRICS_TOKEN>`` when that is
        set."""
        if not metrics.authorized(request.headers.get("authorization"), settings.metrics_token):
            return error_response(401, "unauthorized", "missing or wrong metrics token",
                                  headers={"WWW-Authenticate": "Bearer"})
        return Response(metrics.render([collector]), media_type=metrics.CONTENT_TYPE)

    app.add_middleware(RequestIds)
