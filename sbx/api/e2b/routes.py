"""The routes of E2B's control-plane REST API (:mod:`sbx.api.e2b.rest` holds what they do): the FastAPI
application mounted under ``/e2b``, its exception handlers (every error is E2B's ``{"code", "message"}``; a 5xx
from below is a 503), and the request bodies read as JSON objects."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from sbx.api.auth import Gate
from sbx.api.e2b.pool import Pool
from sbx.api.e2b.rest import Api, E2BError, e2b_error
from sbx.control.accounts.keys import Principal
from sbx.control.errors import ControlError, from_node
from sbx.control.service import ControlPlane
from sbx.node.types import NodeError

log = logging.getLogger("sbx.api.e2b")



async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object (an empty body is ``{}``); 400 otherwise."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise E2BError(400, f"the body is not valid JSON: {e}") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise E2BError(400, "the body must be a JSON object")
    return value


def create_app(cp: ControlPlane, secret: bytes, gate: Gate, ready: Pool | None = None) -> FastAPI:
    """The E2B REST application (mount it at ``/e2b``); ``gate`` checks its keys (the sbx API's own); ``ready``
    learns of the sandboxes it makes (:mod:`sbx.api.e2b.pool`)."""
    api = Api(cp, secret, ready)
    app = FastAPI(title="sbx: E2B-compatible API", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.gate = gate

    @app.exception_handler(E2BError)
    async def _e2b(_req: Request, exc: E2BError) -> JSONResponse:
        return e2b_error(exc.status, exc.message)

    @app.exception_handler(ControlError)
    async def _control(_req: Request, exc: ControlError) -> JSONResponse:
        status = exc.status if exc.status < 500 else 503
        return e2b_error(status, f"{exc.code}: {exc.message}", headers=exc.headers)

    @app.exception_handler(NodeError)
    async def _node(_req: Request, exc: NodeError) -> JSONResponse:
        mapped = from_node(exc.code, exc.message)
        return e2b_error(mapped.status if mapped.status < 500 else 503, f"{mapped.code}: {mapped.message}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return e2b_error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in the E2B API")
        return e2b_error(503, f"internal error ({type(exc).__name__}); see the server log")

    async def who(request: Request) -> Principal:
        return await run_in_threadpool(api.who, request)

    @app.post("/sandboxes", status_code=201)
    @app.post("/v2/sandboxes", status_code=201)
    async def create(request: Request) -> JSONResponse:
        """Create a sandbox (see the module's table)."""
        principal = await who(request)
        body = await _body(request)
        return JSONResponse(await run_in_threadpool(api.create, principal, body), status_code=201)

    @app.get("/sandboxes")
    @app.get("/v2/sandboxes")
    async def list_sandboxes(request: Request) -> JSONResponse:
        """List the account's sandboxes; ``X-Next-Token`` when there are more."""
        principal = await who(request)
        query = dict(request.query_params)
        if request.url.path.endswith("/sandboxes") and "/v2/" not in request.url.path:
            query.setdefault("state", "running")  # v1 listed running sandboxes only
        page, token = await run_in_threadpool(api.list_page, principal, query)
        return JSONResponse(page, headers={"X-Next-Token": token} if token else None)

    @app.get("/sandboxes/{sandbox_id}")
    async def get_sandbox(sandbox_id: str, request: Request) -> JSONResponse:
        """One sandbox's detail."""
        principal = await who(request)
        return JSONResponse(api.detail(await run_in_threadpool(api.row, principal, sandbox_id)))

    @app.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def kill(sandbox_id: str, request: Request) -> Response:
        """Kill (delete) a sandbox."""
        principal = await who(request)
        await run_in_threadpool(api.kill, principal, sandbox_id)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
    async def set_timeout(sandbox_id: str, request: Request) -> Response:
        """Set the sandbox's timeout (its ttl)."""
        principal = await who(request)
        await run_in_threadpool(api.set_timeout, principal, sandbox_id, await _body(request))
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/pause", status_code=204)
    async def pause(sandbox_id: str, request: Request) -> Response:
        """Pause (stop with memory)."""
        principal = await who(request)
        await run_in_threadpool(api.pause, principal, sandbox_id, await _body(request))
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/connect")
    @app.post("/v2/sandboxes/{sandbox_id}/connect")
    async def connect(sandbox_id: str, request: Request) -> JSONResponse:
        """Connect: resume when paused."""
        principal = await who(request)
        status, out = await run_in_threadpool(api.connect, principal, sandbox_id, await _body(request))
        return JSONResponse(out, status_code=status)

    @app.post("/sandboxes/{sandbox_id}/resume", status_code=201)
    async def resume(sandbox_id: str, request: Request) -> JSONResponse:
        """Resume a paused sandbox (E2B's older call); 409 when it runs."""
        principal = await who(request)
        _status, out = await run_in_threadpool(api.connect, principal, sandbox_id, await _body(request), True)
        return JSONResponse(out, status_code=201)

    @app.get("/sandboxes/{sandbox_id}/metrics")
    async def metrics(sandbox_id: str, request: Request) -> JSONResponse:
        """Samples of CPU and memory use."""
        principal = await who(request)
        return JSONResponse(await run_in_threadpool(api.metrics, principal, sandbox_id,
                                                    dict(request.query_params)))

    return app
