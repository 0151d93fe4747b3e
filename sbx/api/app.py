"""The sbx HTTP API (FastAPI). Build it with :func:`create_app`; OpenAPI is served at ``/openapi.json``.

Every ``/v1`` call needs ``Authorization: Bearer <token>`` (or the web console's session cookie, with its CSRF
header for changes: :mod:`sbx.api.auth`); the console itself is served at ``/`` (:mod:`sbx.api.console`).
Errors are always ``{"error": {"code": "...", "message": "...", "field"?, "state"?}}`` (see :mod:`sbx.api.errors`);
request bodies and their limits are :mod:`sbx.api.models`, response bodies :mod:`sbx.api.schemas`.
Streams (exec, job logs, events) are NDJSON: one JSON object per line; a stream whose client went away ends (an
exec's command is killed).

Endpoints::

    GET    /healthz                                    liveness, no auth
    GET    /metrics                                    Prometheus metrics     see sbx.api.observe
    POST   /v1/sandboxes                               create                 202 {"sandbox"}
    HEAD   /healthz                                    liveness, no body
    GET    /v1/sandboxes[?label=k=v]                   list (label filters)   200 {"sandboxes": [...]}
    GET    /v1/sandboxes/{id}                          info                   200 {"sandbox"}
    DELETE /v1/sandboxes/{id}                          delete                 202 {"sandbox"}
    POST   /v1/sandboxes/{id}/stop                     stop (keep memory)     202 {"sandbox"}
    POST   /v1/sandboxes/{id}/resume                   resume / resize        202 {"sandbox"}
    POST   /v1/sandboxes/{id}/fork                     fork                   202 {"sandbox": <the fork>}
    POST   /v1/sandboxes/{id}/migrate                  live migration (admin) 202 {"sandbox"}
    POST   /v1/sandboxes/{id}/snapshot                 named snapshot         201 {"snapshot"}
    GET    /v1/sandboxes/{id}/snapshots                its snapshots          200 {"snapshots": [...]}
    POST   /v1/sandboxes/{id}/exec                     run, streamed          200 NDJSON
    POST   /v1/sandboxes/{id}/jobs                     run detached           201 {"job"}
    GET    /v1/sandboxes/{id}/jobs                     jobs                   200 {"jobs": [...]}
    GET    /v1/sandboxes/{id}/jobs/{job}               one job                200 {"job"}
    POST   /v1/sandboxes/{id}/jobs/{job}/kill          kill it (exit 137)     200 {"job"}
    GET    /v1/sandboxes/{id}/jobs/{job}/logs          output (?follow=true)  200 NDJSON
    GET    /v1/sandboxes/{id}/jobs/{job}/wait          wait for its end       200 {"job"}
    GET    /v1/sandboxes/{id}/events                   lifecycle events       200 NDJSON
    GET    /v1/sandboxes/{id}/stats[?seconds=N]        memory/CPU samples     200 {"sandboxId","samples": [...]}
    POST/GET/DELETE /v1/console/session                console sign-in/out    see sbx.api.console
    ...    /v1/sandboxes/{id}/routes, /files, /pty        hosted ports, files, terminals: see sbx.api.sandbox_io
    GET    /v1/snapshots                               all snapshots          200 {"snapshots": [...]}
    ...    /v1/secrets, /v1/sandboxes/{id}/secrets      credential proxy: see sbx.api.secrets_api
    ...    /v1/ssh-keys                                 SSH gateway keys: see sbx.api.sshkeys_api
    ...    /v1/nodes, /v1/consolidation                 nodes, drains (admin): see sbx.api.nodes_api
    DELETE /v1/snapshots/{name}                        delete a snapshot      200 {"deleted": name}
    ...    /e2b/..., and any request with E2b-Sandbox-Id  E2B's own SDK: see sbx.api.e2b

Long operations answer 202 once accepted; ``?wait=true`` answers 200 when the operation has finished (or its
error). Statuses: 400 invalid_<field> (a value outside its limits) / invalid_resize / invalid_require_memory /
invalid_snapshot_name, 401 unauthorized, 403 permission_denied / protected_path, 404 not_found, 405
method_not_allowed (with Allow), 409 busy / snapshots_disabled / snapshot_exists / invalid_state / not_running /
memory_unavailable / cpu_mismatch, 413 body_too_large, 422 invalid_request (not JSON, wrong shape or type), 502 for
a failing node, 507 no_space /
insufficient_capacity (create, resume or fork would overfill the node's memory or disk; nothing changes).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from sbx import __version__ as sbx_version
from sbx.api import (
    account_routes,
    console,
    errors,
    images_api,
    nodes_api,
    observe,
    sandbox_io,
    secrets_api,
    sshkeys_api,
    volumes_api,
)
from sbx.api import schemas as S
from sbx.api.auth import Gate, ensure_token, owned, principal, require_admin
from sbx.api.e2b.mount import mount as mount_e2b
from sbx.api.models import (
    TIMEOUT_QUERY,
    WAIT_QUERY,
    CreateSandbox,
    ExecCommand,
    ForkSandbox,
    MigrateSandbox,
    ResumeSandbox,
    SnapshotSandbox,
    StartJob,
    StopSandbox,
)
from sbx.config import Settings
from sbx.control.accounts.keys import Principal
from sbx.control.accounts.limits import shared_limits
from sbx.control.cluster.archive import Archiver
from sbx.control.cluster.consolidate import Consolidator
from sbx.control.cluster.diskguard import DiskGuard
from sbx.control.cluster.replicas import Replicator
from sbx.control.errors import ControlError
from sbx.control.reaper import Reaper
from sbx.control.service import ControlPlane, job_view
from sbx.control.store.database import SandboxRow
from sbx.control.store.state import DEFAULT_WAIT
from sbx.node.types import NodeAgent
from sbx.storage.errors import StorageError

log = logging.getLogger("sbx.api")

NDJSON = "application/x-ndjson"
_DONE: dict[int | str, dict[str, Any]] = {200: {"model": S.SandboxOut, "description": "with wait=true: the sandbox "
                                                "once the operation has finished"}}


def _stream(what: str) -> dict[str, Any]:
    """An OpenAPI response entry for an NDJSON stream (one JSON object per line)."""
    return {"description": f"NDJSON: {what}", "content": {NDJSON: {"schema": {"type": "string"}}}}


def _ndjson(make: Callable[[Callable[[], bool]], Iterator[dict[str, Any]]], left: threading.Event | None = None
            ) -> StreamingResponse:
    """Stream the lines of ``make(gone)`` as NDJSON. ``gone()`` (``left.is_set``) turns True once the response has
    ended (the client went away, or the server is shutting down): a follow loop or a running command polls it and
    ends, so no worker thread stays blocked on a stream nobody reads."""
    left = left or threading.Event()
    lines = make(left.is_set)

    async def encode() -> AsyncIterator[str]:
        try:
            async for line in iterate_in_threadpool(lines):
                yield json.dumps(line, separators=(",", ":")) + "\n"
        finally:
            left.set()

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
    serve_ssh: bool = False,
) -> FastAPI:
    """Build the API for ``node`` with ``settings``.

    ``token``: the bearer token (default: read or create ``<state_dir>/token``). ``control``: an existing control
    plane (default: a new one on ``settings.db_url``). ``reaper_tick``: seconds between TTL/auto-snapshot passes.
    ``wait``: seconds a conflicting request waits for an operation in flight before ``409 busy``.
    ``serve_proxy``: also listen for hosted-port traffic on ``settings.proxy_port`` (:mod:`sbx.api.proxy`).
    ``serve_ssh``: also run the SSH gateway on ``settings.ssh_gateway_port`` unless it is 0 (:mod:`sbx.api.sshgateway`;
    a port that can't be bound is logged, the rest of the server runs).
    Starting the app (its lifespan) reconciles with the node and starts the reaper, the consolidation loop
    (:mod:`sbx.control.cluster.consolidate`), the seal replicator (:mod:`sbx.control.cluster.replicas`), the seal
    store's uploader (:mod:`sbx.control.cluster.archive`) and the proxy;
    stopping
    it stops them.
    """
    api_token = token if token is not None else ensure_token(settings)
    cp = control or ControlPlane(settings, node, wait=wait)
    guard = DiskGuard(cp)
    reaper = Reaper(cp, tick=reaper_tick, snapshots_paused=guard.low)
    consolidator = Consolidator(cp)
    replicator = Replicator(cp)
    archiver = Archiver(cp)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        cp.start()
        reaper.start()
        guard.start()
        consolidator.start()
        replicator.start()
        try:
            archiver.start()  # checks the seal store first: a wrong bucket or credentials stop the start here
        except StorageError as e:
            log.error("the seal store %s can't be used: %s", settings.seal_store, e)
            raise
        proxy = None
        if serve_proxy:
            from sbx.api.proxy import Proxy

            proxy = Proxy(cp, settings)
            await proxy.start()
        gateway = None
        if serve_ssh and settings.ssh_gateway_port:
            from sbx.api.sshgateway import SshGateway

            gateway = SshGateway(cp, settings)
            try:
                await gateway.start()
            except OSError as e:
                log.error("the SSH gateway cannot listen on %s:%s: %s", settings.host, settings.ssh_gateway_port, e)
                gateway = None
        try:
            yield
        finally:
            if gateway is not None:
                await gateway.close()
            if proxy is not None:
                await proxy.close()
            archiver.stop()
            replicator.stop()
            consolidator.stop()
            guard.stop()
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
    app.state.consolidator = consolidator
    app.state.diskguard = guard
    cp.accounts.bootstrap(api_token)
    app.state.gate = Gate(cp.accounts, settings, limits=shared_limits(cp.store))  # (PostgreSQL: shared)

    errors.install(app)
    app.add_middleware(errors.BodyLimit, limit=settings.max_body_bytes)

    @app.get("/healthz", tags=["meta"], response_model=S.Health)
    def healthz() -> dict[str, Any]:
        """Liveness check; needs no token (``HEAD`` works too)."""
        return {"ok": True, "version": sbx_version}

    app.head("/healthz", include_in_schema=False)(healthz)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(owned)])
    Who = Depends(principal)

    def settled(sandbox_id: str, timeout: float) -> dict[str, Any]:
        return {"sandbox": cp.view(cp.wait_settled(sandbox_id, timeout))}

    def accepted(row: SandboxRow, wait_: bool, timeout: float) -> JSONResponse:
        if wait_:
            return JSONResponse(settled(row.id, timeout), status_code=200)
        return JSONResponse({"sandbox": cp.view(row)}, status_code=202)

    WaitQ = WAIT_QUERY
    TimeoutQ = TIMEOUT_QUERY

    @v1.post("/sandboxes", status_code=202, tags=["sandboxes"], response_model=S.SandboxOut,
             responses={**S.errors(400, 403, 404, 409, 502, 507), **_DONE, **S.CAPACITY_RESPONSES})
    def create_sandbox(body: CreateSandbox, wait_: bool = WaitQ, timeout: float = TimeoutQ, who: Principal = Who
                       ) -> JSONResponse:
        """Create a sandbox for the key's account; answers 202 in state ``provisioning`` (or 200 once running with
        ``?wait=true``). 403 ``plan_limit`` when the account's plan does not allow the size or another start."""
        from_key = None  # the snapshot's installation-wide key: the name is the account's own
        if body.from_snapshot is not None:
            from_key = cp.find_snapshot(body.from_snapshot, who.account_id, who.admin).name
        cp.secrets.names(who.account_id, body.secrets or [])  # 404/409 before anything is made
        row = cp.create(body.type, body.name, body.ttl, from_key, body.no_snapshots, body.env,
                        body.auto_resume, body.labels, account_id=who.account_id,
                        cold=body.cold, egress=bool(body.secrets), image=body.image, runtime=body.runtime,
                        volumes=[v.model_dump(by_alias=True) for v in body.volumes or []])
        secrets_api.bind_all(cp, row.id, body.secrets, who.account_id)
        return accepted(row, wait_, timeout)

    @v1.get("/sandboxes", tags=["sandboxes"], response_model=S.SandboxList, responses=S.errors(400))
    def list_sandboxes(label: list[str] = Query([], description="only sandboxes with this label, as key=value "
                                                "(repeat for several: all must match)"), who: Principal = Who
                       ) -> dict[str, Any]:
        """Every sandbox of the key's account (the admin: of every account) that is not deleted, oldest first
        (``?label=team=ml`` filters on labels)."""
        wanted: dict[str, str] = {}
        for item in label:
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise ControlError("invalid_label", f"label filters are key=value, got {item[:80]!r}", 400,
                                   field="label")
            wanted[key] = value
        return {"sandboxes": [cp.view(r, space=False) for r in cp.list_sandboxes(wanted, who.scope)]}

    @v1.get("/sandboxes/{sandbox_id}", tags=["sandboxes"], response_model=S.SandboxOut, responses=S.errors(404))
    def get_sandbox(sandbox_id: str) -> dict[str, Any]:
        """One sandbox; ``stats`` is sampled now when it runs (its cost so far: ``GET /v1/usage?sandbox=``)."""
        return {"sandbox": cp.view(cp.get(sandbox_id))}

    @v1.delete("/sandboxes/{sandbox_id}", status_code=202, tags=["sandboxes"], response_model=S.SandboxOut,
               responses={**S.errors(400, 404, 409, 502), **_DONE})
    def delete_sandbox(sandbox_id: str, wait_: bool = WaitQ, timeout: float = TimeoutQ) -> JSONResponse:
        """Delete a sandbox with its disk and automatic snapshots (named snapshots stay)."""
        row = cp.delete(sandbox_id)
        return accepted(row, wait_, timeout)

    @v1.post("/sandboxes/{sandbox_id}/stop", status_code=202, tags=["lifecycle"], response_model=S.SandboxOut,
             responses={**S.errors(400, 404, 409, 502), **_DONE})
    def stop_sandbox(
        sandbox_id: str, body: StopSandbox | None = None, wait_: bool = WaitQ, timeout: float = TimeoutQ
    ) -> JSONResponse:
        """Stop a sandbox, saving its memory (unless ``keepMemory`` is false or it was created with
        ``noSnapshots``). A stopped sandbox is answered as is."""
        row = cp.stop(sandbox_id, keep_memory=(body or StopSandbox.model_validate({})).keep_memory)
        return accepted(row, wait_, timeout)

    @v1.post("/sandboxes/{sandbox_id}/migrate", status_code=202, tags=["nodes"], response_model=S.SandboxOut,
             responses={**S.errors(403, 404, 409, 502, 507), **_DONE})
    def migrate_sandbox(sandbox_id: str, body: MigrateSandbox | None = None, wait_: bool = WaitQ,
                        timeout: float = TimeoutQ, who: Principal = Who) -> JSONResponse:
        """Move the running sandbox to another node while it runs (admin key: nodes are the installation's): to
        node ``to`` when given, else placement picks a ready node with room and the same CPU, kernel and CRIU;
        same id, URL, processes and memory, one short pause. 507 ``insufficient_capacity`` when no other node (or
        not ``to``) may take it, saying why; 404 for an unknown ``to``; 409 ``not_running``, or
        ``invalid_destination`` when ``to`` is the node it runs on. A move that fails leaves it running where it
        was, with ``error`` set (``?wait=true`` answers that error)."""
        require_admin(who)
        to = body.to if body is not None else None
        return accepted(cp.migrate(sandbox_id, to=to), wait_, timeout)

    @v1.post("/sandboxes/{sandbox_id}/resume", status_code=202, tags=["lifecycle"], response_model=S.SandboxOut,
             responses={**S.errors(400, 403, 404, 409, 502, 507), **_DONE, **S.CAPACITY_RESPONSES})
    def resume_sandbox(
        sandbox_id: str, body: ResumeSandbox | None = None, wait_: bool = WaitQ, timeout: float = TimeoutQ
    ) -> JSONResponse:
        """Resume a stopped sandbox, optionally at a bigger ``type`` (a resize: cold boot, memoryRestored false,
        resumeReason "resized"). Waits for a stop still in flight."""
        b = body or ResumeSandbox.model_validate({})
        row = cp.resume(sandbox_id, b.type, b.require_memory, b.ttl)
        return accepted(row, wait_, timeout)

    @v1.post("/sandboxes/{sandbox_id}/fork", status_code=202, tags=["lifecycle"], response_model=S.SandboxOut,
             responses={**S.errors(400, 403, 404, 409, 502, 507), **_DONE, **S.CAPACITY_RESPONSES})
    def fork_sandbox(
        sandbox_id: str, body: ForkSandbox | None = None, wait_: bool = WaitQ, timeout: float = TimeoutQ
    ) -> JSONResponse:
        """Fork a running or stopped sandbox: a new sandbox on a copy of its disk, booted fresh (no memory); with
        ``memory`` a running sandbox's processes and memory go along (409 ``invalid_state`` when it is stopped)."""
        b = body or ForkSandbox.model_validate({})
        account = cp.get(sandbox_id).account_id  # a fork belongs to its source's account, and so do its secrets
        cp.secrets.names(account, b.secrets or [])
        row = cp.fork(sandbox_id, b.type, b.ttl, b.name, b.env, memory=b.memory)
        secrets_api.bind_all(cp, row.id, b.secrets, account)
        return accepted(row, wait_, timeout)

    @v1.post("/sandboxes/{sandbox_id}/snapshot", status_code=201, tags=["snapshots"], response_model=S.SnapshotOut,
             responses=S.errors(400, 403, 404, 409, 502, 507))
    def snapshot_sandbox(sandbox_id: str, body: SnapshotSandbox) -> dict[str, Any]:
        """Save a named, read-only copy of the sandbox's disk (usable with ``fromSnapshot``)."""
        return {"snapshot": cp.snapshot_views([cp.snapshot(sandbox_id, body.name)])[0]}

    @v1.get("/sandboxes/{sandbox_id}/snapshots", tags=["snapshots"], response_model=S.SnapshotList,
            responses=S.errors(404))
    def sandbox_snapshots(sandbox_id: str) -> dict[str, Any]:
        """Snapshots made from this sandbox, oldest first."""
        return {"snapshots": cp.snapshot_views(cp.snapshots(sandbox_id))}

    @v1.get("/snapshots", tags=["snapshots"], response_model=S.SnapshotList, responses=S.errors(404))
    def list_snapshots(sandbox: str | None = Query(None, description="only this sandbox's"), who: Principal = Who
                       ) -> dict[str, Any]:
        """All snapshots of the key's account (the admin: of every account), oldest first."""
        return {"snapshots": cp.snapshot_views(cp.snapshots(sandbox, who.scope))}

    @v1.delete("/snapshots/{name}", tags=["snapshots"], response_model=S.Deleted, responses=S.errors(404, 409, 502))
    def delete_snapshot(name: str, who: Principal = Who) -> dict[str, Any]:
        """Delete one of the key's account's snapshots (the admin key: any account's, its own first)."""
        cp.delete_snapshot(cp.find_snapshot(name, who.account_id, who.admin).name)
        return {"deleted": name}

    @v1.post("/sandboxes/{sandbox_id}/exec", tags=["exec"], response_class=StreamingResponse,
             responses={**S.errors(400, 404, 409, 502), 200: _stream("exec output, then the exit line")})
    def exec_command(sandbox_id: str, body: ExecCommand, request: Request) -> StreamingResponse:
        """Run a command and stream NDJSON lines ``{"stream": "stdout"|"stderr", "data": text}`` (with
        ``"encoding": "base64"`` when asked: ``data`` is then base64 of the exact bytes), then ``{"exitCode": N,
        "timedOut": bool}`` (124 after ``timeout``). Waits for a provisioning or resuming sandbox to run; resumes a
        stopped ``autoResume`` one."""
        left = threading.Event()
        lines = cp.exec(sandbox_id, body.command, body.timeout, body.user, body.env, body.cwd, body.encoding,
                        left.is_set, row=getattr(request.state, "sandbox_row", None))
        return _ndjson(lambda _gone: lines, left)

    @v1.post("/sandboxes/{sandbox_id}/jobs", status_code=201, tags=["exec"], response_model=S.JobOut,
             responses=S.errors(400, 404, 409, 502))
    def start_job(sandbox_id: str, body: StartJob) -> dict[str, Any]:
        """Start a detached job; it keeps running after this call returns (and across stop/resume with memory)."""
        return {"job": job_view(cp.exec_detached(sandbox_id, body.command, body.user, body.env, body.cwd,
                                                 body.timeout, body.stdin))}

    @v1.get("/sandboxes/{sandbox_id}/jobs", tags=["exec"], response_model=S.JobList, responses=S.errors(404, 502))
    def list_jobs(sandbox_id: str) -> dict[str, Any]:
        """The sandbox's detached jobs, oldest first."""
        return {"jobs": [job_view(j) for j in cp.jobs(sandbox_id)]}

    @v1.get("/sandboxes/{sandbox_id}/jobs/{job_id}", tags=["exec"], response_model=S.JobOut,
            responses=S.errors(404, 502))
    def get_job(sandbox_id: str, job_id: str) -> dict[str, Any]:
        """One detached job."""
        return {"job": job_view(cp.job(sandbox_id, job_id))}

    @v1.post("/sandboxes/{sandbox_id}/jobs/{job_id}/kill", tags=["exec"], response_model=S.JobOut,
             responses=S.errors(404, 409, 502))
    def kill_job(sandbox_id: str, job_id: str) -> dict[str, Any]:
        """Kill a running job (SIGKILL to all its processes; it ends with exit 137). An ended job is answered as
        is."""
        return {"job": job_view(cp.kill_job(sandbox_id, job_id))}

    @v1.get("/sandboxes/{sandbox_id}/jobs/{job_id}/logs", tags=["exec"], response_class=StreamingResponse,
            responses={**S.errors(404, 502), 200: _stream("the job's output, then its exit line once ended")})
    def job_logs(sandbox_id: str, job_id: str, follow: bool = False) -> StreamingResponse:
        """A job's output as exec-style NDJSON lines; with ``follow`` until the job ends."""
        return _ndjson(lambda gone: cp.job_logs(sandbox_id, job_id, follow, stop=gone))

    @v1.get("/sandboxes/{sandbox_id}/jobs/{job_id}/wait", tags=["exec"], response_model=S.JobOut,
            responses=S.errors(400, 404, 502))
    def job_wait(sandbox_id: str, job_id: str, timeout: float = Query(300.0, ge=0, le=86400)) -> dict[str, Any]:
        """Wait (at most ``timeout`` seconds) for a job to end; answers the job (``running`` may still be true)."""
        return {"job": job_view(cp.job_wait(sandbox_id, job_id, timeout))}

    @v1.get("/sandboxes/{sandbox_id}/events", tags=["sandboxes"], response_class=StreamingResponse,
            responses={**S.errors(400, 404), 200: _stream("lifecycle events")})
    def sandbox_events(
        sandbox_id: str,
        after: int = Query(0, ge=0, le=2 ** 62, description="only events with seq greater than this"),
        follow: bool = Query(False, description="keep the stream open for new events"),
        until: str | None = Query(None, pattern="^settled$", description="'settled': end once it is stable"),
    ) -> StreamingResponse:
        """Lifecycle events as NDJSON: ``{"event":"state","id","state"}``, ``{"event":"forking","id","source",
        "sandbox"}``, ``{"event":"ready","id","state":"ready","url","sandbox"}``, ``{"event":"error",...}``; each
        carries ``seq``."""
        return _ndjson(lambda gone: cp.events(sandbox_id, after, follow or until == "settled", until == "settled",
                                              stop=gone))

    @v1.get("/sandboxes/{sandbox_id}/stats", tags=["sandboxes"], response_model=S.StatsSeries,
            responses=S.errors(400, 404))
    def sandbox_stats(sandbox_id: str, seconds: float = Query(3600, gt=0, le=3600, description="how far back, in "
                      "seconds (at most one hour)")) -> dict[str, Any]:
        """Memory and CPU samples of the last ``seconds`` (the control plane samples each running sandbox every
        ``SBX_STATS_SAMPLE_SECONDS``, 5 by default, and keeps one hour), oldest first."""
        cp.get(sandbox_id)
        return {"sandboxId": sandbox_id, "intervalSeconds": settings.stats_sample_seconds, "samples": [
            {"at": round(x.at, 3), "memoryUsedMb": x.memory_used_mb, "memoryTotalMb": x.memory_total_mb,
             "cpuPercent": x.cpu_percent} for x in cp.sampler.series(sandbox_id, seconds)]}

    sandbox_io.register(app, v1, cp)
    account_routes.register(v1, cp)
    secrets_api.register(v1, cp)
    sshkeys_api.register(v1, cp)
    images_api.register(v1, cp)
    volumes_api.register(v1, cp)
    nodes_api.register(v1, cp, consolidator)
    console.register(app)
    app.include_router(v1)
    mount_e2b(app, cp, app.state.gate)  # E2B's SDK: REST under /e2b, envd by its E2b-Sandbox-Id header
    observe.register(app, cp, settings)  # GET /metrics, X-Request-Id (issue 35)
    return app
