"""The sbx HTTP API (FastAPI). Build it with :func:`create_app`; OpenAPI is served at ``/openapi.json``.

Every ``/v1`` call needs ``Authorization: Bearer <token>``. Errors are always
``{"error": {"code": "...", "message": "..."}}`` (plus ``"state"`` when a sandbox's state explains a 409).
Streams (exec, job logs, events) are NDJSON: one JSON object per line.

Endpoints::

    GET    /healthz                                    liveness, no auth
    POST   /v1/sandboxes                               create                 202 {"sandbox"}
    GET    /v1/sandboxes                               list                   200 {"sandboxes": [...]}
    GET    /v1/sandboxes/{id}                          info                   200 {"sandbox"}
    DELETE /v1/sandboxes/{id}                          delete                 202 {"sandbox"}
    POST   /v1/sandboxes/{id}/stop                     stop (keep memory)     202 {"sandbox"}
    POST   /v1/sandboxes/{id}/resume                   resume / resize        202 {"sandbox"}
    POST   /v1/sandboxes/{id}/fork                     fork                   202 {"sandbox": <the fork>}
    POST   /v1/sandboxes/{id}/snapshot                 named snapshot         201 {"snapshot"}
    GET    /v1/sandboxes/{id}/snapshots                its snapshots          200 {"snapshots": [...]}
    POST   /v1/sandboxes/{id}/exec                     run, streamed          200 NDJSON
    POST   /v1/sandboxes/{id}/jobs                     run detached           201 {"job"}
    GET    /v1/sandboxes/{id}/jobs                     jobs                   200 {"jobs": [...]}
    GET    /v1/sandboxes/{id}/jobs/{job}               one job                200 {"job"}
    GET    /v1/sandboxes/{id}/jobs/{job}/logs          output (?follow=true)  200 NDJSON
    GET    /v1/sandboxes/{id}/jobs/{job}/wait          wait for its end       200 {"job"}
    GET    /v1/sandboxes/{id}/events                   lifecycle events       200 NDJSON
    ...    /v1/sandboxes/{id}/routes, /files, /pty        hosted ports, files, terminals: see sbx.api.sandbox_io
    GET    /v1/snapshots                               all snapshots          200 {"snapshots": [...]}
    DELETE /v1/snapshots/{name}                        delete a snapshot      200 {"deleted": name}

Long operations answer 202 once accepted; ``?wait=true`` answers 200 when the operation has finished (or its
error). Statuses: 400 invalid_type / invalid_resize / invalid_require_memory / invalid_snapshot_name /
invalid_name / invalid_ttl, 401 unauthorized, 404 not_found, 409 busy / snapshots_disabled / snapshot_exists /
invalid_state / not_running / memory_unavailable, 422 invalid_request, 502 for a failing node, 507
insufficient_capacity when create, resume or fork would overfill the node's memory or disk (nothing changes).
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from sbx import __version__ as sbx_version
from sbx.api import sandbox_io
from sbx.api.auth import ensure_token
from sbx.api.models import (
    CreateSandbox,
    ExecCommand,
    ForkSandbox,
    ResumeSandbox,
    SnapshotSandbox,
    StartJob,
    StopSandbox,
)
from sbx.config import Settings
from sbx.control.errors import ControlError, from_node
from sbx.control.reaper import Reaper
from sbx.control.service import ControlPlane, job_view
from sbx.control.state import DEFAULT_WAIT
from sbx.control.store import SandboxRow
from sbx.node.types import NodeAgent, NodeError

log = logging.getLogger("sbx.api")

NDJSON = "application/x-ndjson"
WAIT_TIMEOUT = 900.0

CAPACITY_RESPONSES: dict[int | str, dict[str, Any]] = {
    507: {
        "description": "insufficient_capacity: the node cannot hold the sandbox's memory (sum of memory limits of "
        "sandboxes that are not stopped, against (host RAM - SBX_MEMORY_RESERVE_MIB) x SBX_MEMORY_OVERCOMMIT) or "
        "its disk (free space under the data volume minus SBX_DISK_RESERVE_GIB); nothing was changed",
        "content": {"application/json": {"example": {"error": {
            "code": "insufficient_capacity",
            "message": "not enough memory on this node for a new small sandbox (4096 MiB): sandboxes that are not "
            "stopped already hold 90112 MiB of the 92324 MiB this node may promise ((24105 MiB RAM - 1024 MiB "
            "reserve) x overcommit 4); stop or delete a sandbox, or raise SBX_MEMORY_OVERCOMMIT"}}}},
    }
}
"""OpenAPI ``responses`` of the operations that admit a sandbox (create, resume, fork)."""


def _error(status: int, code: str, message: str, state: str | None = None, headers: dict[str, str] | None = None
           ) -> JSONResponse:
    body: dict[str, Any] = {"code": code, "message": message}
    if state is not None:
        body["state"] = state
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def _ndjson(lines: Iterator[dict[str, Any]]) -> StreamingResponse:
    def encode() -> Iterator[str]:
        for line in lines:
            yield json.dumps(line, separators=(",", ":")) + "\n"

    return StreamingResponse(encode(), media_type=NDJSON)


def create_app(
    settings: Settings,
    node: NodeAgent,
    *,
    token: str | None = None,
    control: ControlPlane | None = None,
    reaper_tick: float = 5.0,
    wait: float = DEFAULT_WAIT,
    serve_proxy: bool = False,
) -> FastAPI:
    """Build the API for ``node`` with ``settings``.

    ``token``: the bearer token (default: read or create ``<state_dir>/token``). ``control``: an existing control
    plane (default: a new one on ``settings.db_url``). ``reaper_tick``: seconds between TTL/auto-snapshot passes.
    ``wait``: seconds a conflicting request waits for an operation in flight before ``409 busy``.
    ``serve_proxy``: also listen for hosted-port traffic on ``settings.proxy_port`` (:mod:`sbx.api.proxy`).
    Starting the app (its lifespan) reconciles with the node and starts the reaper (and the proxy); stopping it stops
    them.
    """
    api_token = token if token is not None else ensure_token(settings)
    cp = control or ControlPlane(settings, node, wait=wait)
    reaper = Reaper(cp, tick=reaper_tick)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        cp.start()
        reaper.start()
        proxy = None
        if serve_proxy:
            from sbx.api.proxy import Proxy

            proxy = Proxy(cp, settings)
            await proxy.start()
        try:
            yield
        finally:
            if proxy is not None:
                await proxy.close()
            reaper.stop()
            cp.close()

    app = FastAPI(
        title="sbx",
        version=sbx_version,
        description="Self-hosted machine-like sandboxes: create, exec, stop with memory, resume, resize, fork, "
        "snapshots.",
        lifespan=lifespan,
    )
    app.state.control = cp
    app.state.reaper = reaper

    @app.exception_handler(ControlError)
    async def _control_error(_req: Request, exc: ControlError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _error(exc.status, exc.code, exc.message, exc.state, headers)

    @app.exception_handler(NodeError)
    async def _node_error(_req: Request, exc: NodeError) -> JSONResponse:
        mapped = from_node(exc.code, exc.message)
        return _error(mapped.status, mapped.code, mapped.message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            loc = tuple(err.get("loc", ()))
            if err.get("type") == "json_invalid":  # loc is ("body", <byte offset>)
                at = f" at byte {loc[-1]}" if len(loc) > 1 else ""
                parts.append(f"the body is not valid JSON{at}: {err.get('ctx', {}).get('error', err.get('msg'))}")
                continue
            if loc == ("body",) and err.get("type") in ("model_attributes_type", "dict_type"):
                parts.append("the body must be a JSON object, sent with Content-Type: application/json")
                continue
            where = ".".join(str(p) for p in loc if p != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return _error(422, "invalid_request", "; ".join(parts) or "malformed request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(500, "internal", f"{type(exc).__name__}: {exc}")

    bearer = HTTPBearer(auto_error=False, description="The server's API token (sbx server writes it to "
                        "~/.config/sbx/config.toml)")

    def auth(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if creds is None or creds.scheme.lower() != "bearer" or not secrets.compare_digest(
            creds.credentials.encode(), api_token.encode()
        ):
            raise ControlError("unauthorized", "missing or wrong API token", 401)

    @app.get("/healthz", tags=["meta"])
    def healthz() -> dict[str, Any]:
        """Liveness check; needs no token."""
        return {"ok": True, "version": sbx_version}

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(auth)])

    def settled(sandbox_id: str, timeout: float) -> dict[str, Any]:
        return {"sandbox": cp.view(cp.wait_settled(sandbox_id, timeout))}

    def accepted(row: SandboxRow, wait_: bool, timeout: float) -> JSONResponse:
        if wait_:
            return JSONResponse(settled(row.id, timeout), status_code=200)
        return JSONResponse({"sandbox": cp.view(row)}, status_code=202)

    WaitQ = Query(False, alias="wait", description="answer when the operation has finished")
    TimeoutQ = Query(WAIT_TIMEOUT, alias="timeout", ge=0, description="longest wait in seconds with wait=true")

    @v1.post("/sandboxes", status_code=202, tags=["sandboxes"], responses=CAPACITY_RESPONSES)
    def create_sandbox(body: CreateSandbox, wait_: bool = WaitQ, timeout: float = TimeoutQ) -> JSONResponse:
        """Create a sandbox; answers 202 in state ``provisioning`` (or 200 once running with ``?wait=true``)."""
        row = cp.create(body.type, body.name, body.ttl, body.from_snapshot, body.no_snapshots, body.env,
                        body.auto_resume)
        return accepted(row, wait_, timeout)

    @v1.get("/sandboxes", tags=["sandboxes"])
    def list_sandboxes() -> dict[str, Any]:
        """Every sandbox that is not deleted, oldest first, with fresh stats for running ones."""
        return {"sandboxes": [cp.view(r, space=False) for r in cp.list_sandboxes()]}

    @v1.get("/sandboxes/{sandbox_id}", tags=["sandboxes"])
    def get_sandbox(sandbox_id: str) -> dict[str, Any]:
        """One sandbox; ``stats`` is sampled now when it runs."""
        return {"sandbox": cp.view(cp.get(sandbox_id))}

    @v1.delete("/sandboxes/{sandbox_id}", status_code=202, tags=["sandboxes"])
    def delete_sandbox(sandbox_id: str, wait_: bool = WaitQ, timeout: float = TimeoutQ) -> JSONResponse:
        """Delete a sandbox with its disk and automatic snapshots (named snapshots stay)."""
        row = cp.delete(sandbox_id)
        return accepted(row, wait_, timeout)

    @v1.post("/sandboxes/{sandbox_id}/stop", status_code=202, tags=["lifecycle"])
    def stop_sandbox(
        sandbox_id: str, body: StopSandbox | None = None, wait_: bool = WaitQ, timeout: float = TimeoutQ
    ) -> JSONResponse:
        """Stop a sandbox, saving its memory (unless ``keepMemory`` is false or it was created with
        ``noSnapshots``). A stopped sandbox is answered as is."""
        row = cp.stop(sandbox_id, keep_memory=(body or StopSandbox.model_validate({})).keep_memory)
        return accepted(row, wait_, timeout)

    @v1.post("/sandboxes/{sandbox_id}/resume", status_code=202, tags=["lifecycle"], responses=CAPACITY_RESPONSES)
    def resume_sandbox(
        sandbox_id: str, body: ResumeSandbox | None = None, wait_: bool = WaitQ, timeout: float = TimeoutQ
    ) -> JSONResponse:
        """Resume a stopped sandbox, optionally at a bigger ``type`` (a resize: cold boot, memoryRestored false,
        resumeReason "resized"). Waits for a stop still in flight."""
        b = body or ResumeSandbox.model_validate({})
        row = cp.resume(sandbox_id, b.type, b.require_memory, b.ttl)
        return accepted(row, wait_, timeout)

    @v1.post("/sandboxes/{sandbox_id}/fork", status_code=202, tags=["lifecycle"], responses=CAPACITY_RESPONSES)
    def fork_sandbox(
        sandbox_id: str, body: ForkSandbox | None = None, wait_: bool = WaitQ, timeout: float = TimeoutQ
    ) -> JSONResponse:
        """Fork a running or stopped sandbox: a new sandbox on a copy of its disk, booted fresh (no memory)."""
        b = body or ForkSandbox.model_validate({})
        row = cp.fork(sandbox_id, b.type, b.ttl, b.name, b.env)
        return accepted(row, wait_, timeout)

    @v1.post("/sandboxes/{sandbox_id}/snapshot", status_code=201, tags=["snapshots"])
    def snapshot_sandbox(sandbox_id: str, body: SnapshotSandbox) -> dict[str, Any]:
        """Save a named, read-only copy of the sandbox's disk (usable with ``fromSnapshot``)."""
        return {"snapshot": cp.snapshot_views([cp.snapshot(sandbox_id, body.name)])[0]}

    @v1.get("/sandboxes/{sandbox_id}/snapshots", tags=["snapshots"])
    def sandbox_snapshots(sandbox_id: str) -> dict[str, Any]:
        """Snapshots made from this sandbox, oldest first."""
        return {"snapshots": cp.snapshot_views(cp.snapshots(sandbox_id))}

    @v1.get("/snapshots", tags=["snapshots"])
    def list_snapshots(sandbox: str | None = Query(None, description="only this sandbox's")) -> dict[str, Any]:
        """All snapshots, oldest first."""
        return {"snapshots": cp.snapshot_views(cp.snapshots(sandbox))}

    @v1.delete("/snapshots/{name}", tags=["snapshots"])
    def delete_snapshot(name: str) -> dict[str, Any]:
        """Delete a snapshot."""
        cp.delete_snapshot(name)
        return {"deleted": name}

    @v1.post("/sandboxes/{sandbox_id}/exec", tags=["exec"], response_class=StreamingResponse)
    def exec_command(sandbox_id: str, body: ExecCommand) -> StreamingResponse:
        """Run a command and stream NDJSON lines ``{"stream": "stdout"|"stderr", "data": text}``, then
        ``{"exit_code": N, "timed_out": bool}``. Waits for a provisioning or resuming sandbox to run."""
        lines = cp.exec(sandbox_id, body.command, body.timeout, body.user, body.env, body.cwd)
        return _ndjson(lines)

    @v1.post("/sandboxes/{sandbox_id}/jobs", status_code=201, tags=["exec"])
    def start_job(sandbox_id: str, body: StartJob) -> dict[str, Any]:
        """Start a detached job; it keeps running after this call returns."""
        return {"job": job_view(cp.exec_detached(sandbox_id, body.command, body.user))}

    @v1.get("/sandboxes/{sandbox_id}/jobs", tags=["exec"])
    def list_jobs(sandbox_id: str) -> dict[str, Any]:
        """The sandbox's detached jobs, oldest first."""
        return {"jobs": [job_view(j) for j in cp.jobs(sandbox_id)]}

    @v1.get("/sandboxes/{sandbox_id}/jobs/{job_id}", tags=["exec"])
    def get_job(sandbox_id: str, job_id: str) -> dict[str, Any]:
        """One detached job."""
        return {"job": job_view(cp.job(sandbox_id, job_id))}

    @v1.get("/sandboxes/{sandbox_id}/jobs/{job_id}/logs", tags=["exec"], response_class=StreamingResponse)
    def job_logs(sandbox_id: str, job_id: str, follow: bool = False) -> StreamingResponse:
        """A job's output as exec-style NDJSON lines; with ``follow`` until the job ends."""
        return _ndjson(cp.job_logs(sandbox_id, job_id, follow))

    @v1.get("/sandboxes/{sandbox_id}/jobs/{job_id}/wait", tags=["exec"])
    def job_wait(sandbox_id: str, job_id: str, timeout: float = Query(300.0, ge=0)) -> dict[str, Any]:
        """Wait (at most ``timeout`` seconds) for a job to end; answers the job (``running`` may still be true)."""
        return {"job": job_view(cp.job_wait(sandbox_id, job_id, timeout))}

    @v1.get("/sandboxes/{sandbox_id}/events", tags=["sandboxes"], response_class=StreamingResponse)
    def sandbox_events(
        sandbox_id: str,
        after: int = Query(0, ge=0, description="only events with seq greater than this"),
        follow: bool = Query(False, description="keep the stream open for new events"),
        until: str | None = Query(None, pattern="^settled$", description="'settled': end once it is stable"),
    ) -> StreamingResponse:
        """Lifecycle events as NDJSON: ``{"event":"state","id","state"}``, ``{"event":"forking","id","source",
        "sandbox"}``, ``{"event":"ready","id","state":"ready","url","sandbox"}``, ``{"event":"error",...}``; each
        carries ``seq``."""
        return _ndjson(cp.events(sandbox_id, after, follow or until == "settled", until == "settled"))

    sandbox_io.register(app, v1, cp, api_token)
    app.include_router(v1)
    return app
