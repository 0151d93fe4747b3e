"""API endpoints for getting into a sandbox: hosted-port routes, files, and PTY sessions (``sbx ssh``).

Added to the ``/v1`` router by :func:`register` (so they share its auth), except the PTY WebSocket, which checks
the same bearer key or console session itself (:meth:`sbx.api.auth.Gate.authorize`; with the session cookie it must
come from the console's origin and carry ``?csrf=``)::

    POST   /v1/sandboxes/{id}/routes                 host a port {"port","public"}    201 {"route"}
    GET    /v1/sandboxes/{id}/routes                 its routes                        200 {"routes": [...]}
    DELETE /v1/sandboxes/{id}/routes/{port}          unhost                            200 {"deleted": port}
    GET    /v1/sandboxes/{id}/files?path=P           file bytes (streamed)             200 octet-stream
    GET    /v1/sandboxes/{id}/files?path=D&archive=tar   directory as a tar stream    200 x-tar
    PUT    /v1/sandboxes/{id}/files?path=P           write a file from the body        200 {"path","size"}
    PUT    /v1/sandboxes/{id}/files?path=D&archive=tar   extract a tar body into D    200 {"path","size"}
    DELETE /v1/sandboxes/{id}/files?path=P           remove (recursively)              200 {"deleted": P}
    GET    /v1/sandboxes/{id}/files/list?path=D      directory entries                 200 {"entries": [...]}
    GET    /v1/sandboxes/{id}/files/stat?path=P      one entry                         200 {"entry"}
    WS     /v1/sandboxes/{id}/pty?command=C&user=U&cols=N&rows=N&term=T   a terminal

Files take ``user`` (``user`` or ``root``, default ``user``); see :mod:`sbx.control.sandboxes.files` for paths and
errors.

The PTY WebSocket: the client sends binary frames (keyboard bytes) and text frames with JSON
``{"type":"resize","cols":N,"rows":N}`` or ``{"type":"eof"}`` (sends ^D); the server sends binary frames (terminal
output) and finally ``{"type":"exit","exitCode":N}``, or ``{"type":"error","code","message"}`` if the session
cannot start, then closes. Without ``command`` the session is a login shell (``bash -l``); with it, ``bash -lc C``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import tty
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Path, Query, Request, WebSocket
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.websockets import WebSocketDisconnect

from sbx.api import schemas as S
from sbx.api.auth import Gate, check_sandbox
from sbx.api.models import HostPort
from sbx.control.errors import ControlError
from sbx.control.service import ControlPlane
from sbx.node.exec.terminal import set_winsize
from sbx.node.host.tools import hang_up
from sbx.node.types import NodeError

log = logging.getLogger("sbx.api")

UPLOAD_BATCH = 1 << 20
"""Bytes of request body gathered before one write into the sandbox."""
TAR_BLOCK = 512
_FILE_ERRORS = (400, 403, 404, 409, 502, 507)
_BYTES: dict[str, Any] = {"description": "the file's bytes (or a tar stream with archive=tar)", "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    "application/x-tar": {"schema": {"type": "string", "format": "binary"}}}}
_UPLOAD: dict[str, Any] = {"requestBody": {"required": False, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}
User = Literal["user", "root"]


def looks_like_tar(head: bytes) -> bool:
    """Whether ``head`` (the first 512 bytes of a body, or all of a shorter one) starts a tar archive: a header
    block whose checksum (bytes 148-155, octal) matches its bytes, or an all-zero end-of-archive block."""
    block = head[:TAR_BLOCK]
    if len(block) < TAR_BLOCK:
        return False
    if block == bytes(TAR_BLOCK):
        return True
    field = block[148:156].replace(b"\0", b" ").strip()
    try:
        want = int(field, 8)
    except ValueError:
        return False
    rest = block[:148] + b" " * 8 + block[156:]
    return want in (sum(rest), sum(b - 256 if b > 127 else b for b in rest))


def register(app: FastAPI, v1: APIRouter, cp: ControlPlane) -> None:
    """Add the routes, files and PTY endpoints. Call before ``app.include_router(v1)``."""
    _routes(v1, cp)
    _files(v1, cp)
    _pty(app, cp)


def _routes(v1: APIRouter, cp: ControlPlane) -> None:
    @v1.post("/sandboxes/{sandbox_id}/routes", status_code=201, tags=["ports"], response_model=S.RouteOut,
             responses=S.errors(400, 404))
    def host_port(sandbox_id: str, body: HostPort) -> dict[str, Any]:
        """Publish a port of the sandbox at ``https://<port>-<subdomain>.<domain>``; a private route needs its
        ``token`` (``X-Sbx-Token`` header, or ``?token=`` once, which sets a cookie). Hosting again keeps the
        token."""
        row = cp.routes.host(sandbox_id, body.port, body.public)
        return {"route": cp.routes.view(row, cp.get(sandbox_id).subdomain)}

    @v1.get("/sandboxes/{sandbox_id}/routes", tags=["ports"], response_model=S.RouteList, responses=S.errors(404))
    def list_routes(sandbox_id: str) -> dict[str, Any]:
        """The sandbox's hosted ports, by port."""
        sub = cp.get(sandbox_id).subdomain
        return {"routes": [cp.routes.view(r, sub) for r in cp.routes.list(sandbox_id)]}

    @v1.delete("/sandboxes/{sandbox_id}/routes/{port}", tags=["ports"], response_model=S.Deleted,
               responses=S.errors(400, 404))
    def unhost_port(sandbox_id: str, port: int = Path(ge=1, le=65535)) -> dict[str, Any]:
        """Stop publishing a port."""
        cp.routes.unhost(sandbox_id, port)
        return {"deleted": port}


def _files(v1: APIRouter, cp: ControlPlane) -> None:
    ArchiveQ = Query(None, pattern="^tar$", description="'tar': a directory as a tar stream")
    UserQ = Query("user", description="'user' (default) or 'root'")
    PathQ = Query(..., min_length=1, max_length=4096,
                  description="path in the sandbox (absolute, or relative to the user's home; ~ allowed)")

    @v1.get("/sandboxes/{sandbox_id}/files", tags=["files"], response_class=StreamingResponse,
            responses={**S.errors(*_FILE_ERRORS), 200: _BYTES})
    def read_file(sandbox_id: str, path: str = PathQ, archive: str | None = ArchiveQ, user: User = UserQ
                  ) -> StreamingResponse:
        """A file's bytes, streamed (or a directory as a tar stream with ``archive=tar``)."""
        if archive:
            return StreamingResponse(cp.files.open_tar(sandbox_id, path, user), media_type="application/x-tar")
        return StreamingResponse(cp.files.open_read(sandbox_id, path, user), media_type="application/octet-stream")

    @v1.put("/sandboxes/{sandbox_id}/files", tags=["files"], response_model=S.Written,
            responses=S.errors(*_FILE_ERRORS), openapi_extra=_UPLOAD)
    async def write_file(request: Request, sandbox_id: str, path: str = PathQ, archive: str | None = ArchiveQ,
                         user: User = UserQ) -> dict[str, Any] | Response:
        """Write the request body to a file (parents made, owned by ``user``), or extract a tar body into a
        directory with ``archive=tar``. The body is streamed into the sandbox."""
        opener = cp.files.open_untar if archive else cp.files.open_write
        body = request.stream()
        head = b""
        if archive:  # refuse a body that is not a tar archive before anything is made in the sandbox
            try:
                async for chunk in body:
                    head += chunk
                    if len(head) >= TAR_BLOCK:
                        break
            except ClientDisconnect:
                return Response(status_code=499)
            if not looks_like_tar(head):
                raise ControlError("invalid_archive", "the body is not a tar archive (archive=tar takes an "
                                   "uncompressed POSIX/GNU tar stream)", 400)
        writer = await run_in_threadpool(opener, sandbox_id, path, user)
        try:
            batch: list[bytes] = [head] if head else []
            size = len(head)
            async for chunk in body:
                batch.append(chunk)
                size += len(chunk)
                if size >= UPLOAD_BATCH:
                    await run_in_threadpool(writer.write, b"".join(batch))
                    batch, size = [], 0
            if batch:
                await run_in_threadpool(writer.write, b"".join(batch))
        except ClientDisconnect:  # the client went away mid-upload: the target file is left as it was
            await run_in_threadpool(writer.abort)
            log.info("upload to %s:%s cut short by the client", sandbox_id, path)
            return Response(status_code=499)
        except BaseException:
            await run_in_threadpool(writer.abort)
            raise
        written = await run_in_threadpool(writer.finish)
        return {"path": path, "size": written}

    @v1.delete("/sandboxes/{sandbox_id}/files", tags=["files"], response_model=S.Deleted,
               responses=S.errors(*_FILE_ERRORS))
    def remove_file(sandbox_id: str, path: str = PathQ, user: User = UserQ) -> dict[str, Any]:
        """Remove a file or a directory with everything in it."""
        cp.files.remove(sandbox_id, path, user)
        return {"deleted": path}

    @v1.get("/sandboxes/{sandbox_id}/files/list", tags=["files"], response_model=S.FileList,
            responses=S.errors(*_FILE_ERRORS))
    def list_files(sandbox_id: str, path: str = PathQ, user: User = UserQ) -> dict[str, Any]:
        """A directory's entries: ``{"name","path","type","size","mode","mtime"}``, sorted by name."""
        return {"entries": cp.files.list(sandbox_id, path, user)}

    @v1.get("/sandboxes/{sandbox_id}/files/stat", tags=["files"], response_model=S.FileEntryOut,
            responses=S.errors(*_FILE_ERRORS))
    def stat_file(sandbox_id: str, path: str = PathQ, user: User = UserQ) -> dict[str, Any]:
        """One entry for ``path`` (a symlink is followed when it resolves)."""
        return {"entry": cp.files.stat(sandbox_id, path, user)}


# --- PTY sessions ---------------------------------------------------------------------------------------------
def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def _open_pty(cp: ControlPlane, sandbox_id: str, argv: list[str], user: str, term: str, size: tuple[int, int]
              ) -> subprocess.Popen[bytes]:
    if user not in ("user", "root"):
        raise ControlError("invalid_user", "user must be 'user' or 'root'", 400)
    cp.wait_running(sandbox_id)
    try:
        return cp.node.spawn(sandbox_id, argv, user=user, tty=True, env={"TERM": term}, size=size)
    except NodeError as e:
        raise ControlError(e.code, e.message, 409 if e.code == "not_running" else 502) from None


async def _fd_ready(fd: int, writer: bool = False) -> None:
    """Wait until ``fd`` is readable (or writable)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    (loop.add_writer if writer else loop.add_reader)(fd, ready)
    try:
        await fut
    finally:
        (loop.remove_writer if writer else loop.remove_reader)(fd)




def _pty(app: FastAPI, cp: ControlPlane) -> None:
    def authorize(ws: WebSocket, sandbox_id: str) -> None:
        """The same key (or console session) check and ownership check as every other ``/v1`` route
        (:meth:`sbx.api.auth.Gate.authorize`, with the WebSocket's CSRF rule for a session cookie)."""
        gate: Gate = app.state.gate
        who = gate.authorize("GET", ws.headers, ws.cookies, ws.client.host if ws.client else "unknown",
                             ws.query_params, websocket=True)
        check_sandbox(cp, who, sandbox_id)

    @app.websocket("/v1/sandboxes/{sandbox_id}/pty")
    async def pty_session(ws: WebSocket, sandbox_id: str) -> None:
        await ws.accept()

        async def refuse(code: str, message: str) -> None:
            await ws.send_text(json.dumps({"type": "error", "code": code, "message": message}))
            await ws.close(code=4000)

        try:
            await run_in_threadpool(authorize, ws, sandbox_id)
        except ControlError as e:
            await refuse(e.code, e.message)
            return
        q = ws.query_params
        command = q.get("command")
        argv = ["/bin/bash", "-lc", command] if command else ["/bin/bash", "-l"]
        cols, rows = _int(q.get("cols"), 80), _int(q.get("rows"), 24)
        try:
            proc = await run_in_threadpool(_open_pty, cp, sandbox_id, argv, q.get("user", "user"),
                                           q.get("term") or "xterm-256color", (cols, rows))
        except ControlError as e:
            await refuse(e.code, e.message)
            return
        cp.activity.begin(sandbox_id)
        master: int = proc.pty_master  # type: ignore[attr-defined]
        try:
            await _session(ws, proc, master, cols, rows, lambda: cp.activity.touch(sandbox_id))
        finally:
            os.close(master)
            await run_in_threadpool(hang_up, proc)
            cp.activity.end(sandbox_id)


async def _session(ws: WebSocket, proc: subprocess.Popen[bytes], master: int, cols: int, rows: int,
                   touch: Callable[[], None]) -> None:
    os.set_blocking(master, False)
    with contextlib.suppress(OSError):
        # the host side of the pair only relays bytes to runc, which relays them to the sandbox's own terminal
        # (where echo, line editing and ^D happen): keep it raw, so nothing is echoed or cooked twice
        tty.setraw(master)
        set_winsize(master, cols, rows)
    resized = False

    async def write_all(data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(master, view)
                view = view[n:]
            except BlockingIOError:
                await _fd_ready(master, writer=True)

    async def pump_out() -> None:
        nonlocal resized
        while True:
            await _fd_ready(master)
            try:
                data = os.read(master, 65536)
            except BlockingIOError:
                continue
            except OSError:  # EIO: the command and runc have closed the terminal
                return
            if not data:
                return
            if not resized:  # runc handles SIGWINCH only once it relays: tell it the size now
                resized = True
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGWINCH)
            await ws.send_bytes(data)
            touch()

    async def pump_in() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(msg.get("code", 1000))
            if msg.get("bytes"):
                await write_all(msg["bytes"])
            elif msg.get("text"):
                try:
                    ctl = json.loads(msg["text"])
                except ValueError:
                    continue
                if ctl.get("type") == "resize":
                    with contextlib.suppress(OSError, TypeError, ValueError):
                        set_winsize(master, int(ctl["cols"]), int(ctl["rows"]))
                        proc.send_signal(signal.SIGWINCH)
                elif ctl.get("type") == "eof":
                    await write_all(b"\x04")
            touch()

    out_task = asyncio.create_task(pump_out())
    in_task = asyncio.create_task(pump_in())
    try:
        done, _ = await asyncio.wait({out_task, in_task}, return_when=asyncio.FIRST_COMPLETED)
        if in_task in done:  # the client left (or sent garbage): end the session
            return
        code = await run_in_threadpool(proc.wait)
        await ws.send_text(json.dumps({"type": "exit", "exitCode": code if code >= 0 else 128 - code}))
        await ws.close()
    except WebSocketDisconnect:
        return
    finally:
        for t in (out_task, in_task):
            t.cancel()
        for t in (out_task, in_task):
            with contextlib.suppress(BaseException):
                await t
