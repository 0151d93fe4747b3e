"""The node's own HTTP API (``sbx node serve``): a :class:`sbx.node.agent.LocalNode` served to control planes.

Every route needs ``Authorization: Bearer <node token>`` (compared in constant time); anything else is 401
``unauthorized`` (a WebSocket is closed with code 4401 before it is accepted). Routes (:mod:`sbx.node.remote.wire`
has the shapes):

- ``GET /metrics``: Prometheus metrics of the node process (:mod:`sbx.metrics`: CRIU runs and failures, node
  calls); no node token, ``Bearer <SBX_METRICS_TOKEN>`` when that is set;
- ``GET /v1/node/health``: ``{"ok": true, "node": <node name>, "egress": <whether its egress proxy runs>}``;
- ``POST /v1/node/egress/poll`` and ``.../answer``: the egress proxy's questions, long-polled by the servers
  (:mod:`sbx.node.remote.egresslink`);
- ``POST /v1/node/call/<method>``: one plain :class:`sbx.node.types.NodeAgent` call of :data:`wire.CALLS`;
- ``POST /v1/node/exec``: an attached exec as NDJSON events;
- ``WS /v1/node/spawn``: a process with pipes or a pty (:mod:`sbx.node.remote.spawned` has the frames);
- ``GET /v1/node/exits?after=N&wait=S&boot=B``: sandboxes that ended on their own (the node's watcher), after
  sequence number ``N`` (``-1``: only the current last number) of the node process ``B``, waiting up to ``S``
  seconds (at most 30) for one;
- ``/v1/node/migrate/<id>/...``: a sandbox arriving from another node (:mod:`sbx.node.migration.incoming`). These take
  ``Authorization: Bearer <migration ticket>`` instead of the node token: the one-time ticket ``migrate_prepare``
  gave for that sandbox, so the source node sends its files here without knowing this node's token.
  ``PUT .../base|final|memory`` (a :mod:`sbx.node.migration.filestream` body), ``POST .../pages`` (``{"address",
  "port"}`` of a page server for the memory dump, for the caller's address only), ``POST .../restore``, ``POST
  .../confirm``, ``POST .../abort``, ``GET ...`` (``{"state"}``). Errors: 401 ``unauthorized`` (no such
  arrival or a wrong ticket), 400 ``bad_stream``, 409 a :class:`sbx.node.types.NodeError`.
- ``GET /v1/node/relay``: ``{"port": P}`` of the node's port relay (:mod:`sbx.node.remote.relay`; 0: none);
- ``GET /v1/node/transfer/<id>/<name>``: a file of a stopped sandbox's export, streamed
  (:mod:`sbx.node.migration.transfer`);
- ``PUT /v1/node/transfer/<id>/<name>``: a file of an import, streamed in and hash-checked (409
  ``transfer_corrupt`` when its SHA-256 differs from the manifest's); ``GET`` with ``?kind=replica``: a file of
  an export for a seal replica;
- ``PUT /v1/node/replica/<id>/<name>``: a file of a seal replica, likewise (:mod:`sbx.node.migration.replicas`).
- ``POST /v1/node/images/build`` and ``.../import``: an image built or imported here
  (:mod:`sbx.node.remote.imagelink`).

The node agent process watches its own sandboxes from its start; each control plane polls ``exits``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import queue
import re
import secrets
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from sbx import logs, metrics
from sbx.node.migration.filestream import StreamError
from sbx.node.remote import wire
from sbx.node.remote.egresslink import EgressLink, egress_routes
from sbx.node.remote.imagelink import image_routes
from sbx.node.remote.relay import make_handler
from sbx.node.remote.streams import exec_lines, relay_process
from sbx.node.types import NodeAgent, NodeError

log = logging.getLogger("sbx.node.remote")

MIGRATE_PREFIX = "/v1/node/migrate/"
_MIGRATE_ID = re.compile(r"^[a-z0-9_]{1,40}$")
_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_SANDBOX_ID = re.compile(r"^sb_[a-z0-9]{10}$")



def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


class Exits:
    """The node watcher's reports, numbered, for control planes to poll (the last 1000 are kept)."""

    def __init__(self) -> None:
        self._items: list[dict[str, Any]] = []
        self._seq = 0
        self._cond = threading.Condition()
        self.boot = secrets.token_hex(8)  # a poller that knew another boot of this node starts again from 0

    def add(self, sandbox_id: str, kind: str, detail: str | None) -> None:
        """Record that ``sandbox_id`` ended on its own (``kind``: poweroff, reboot, crashed)."""
        with self._cond:
            self._seq += 1
            self._items.append({"seq": self._seq, "id": sandbox_id, "kind": kind, "detail": detail})
            del self._items[:-1000]
            self._cond.notify_all()

    def after(self, seq: int, wait: float, boot: str = "") -> dict[str, Any]:
        """``{"events": [...], "last": N, "boot": B}``: the reports numbered above ``seq``, waiting up to ``wait``
        seconds for one. ``seq < 0`` answers at once with no events (a new poller starts from ``last``); a
        ``boot`` other than this process's (the node restarted since) counts from 0, so no report is missed."""
        if boot and boot != self.boot:
            seq = 0
        with self._cond:
            if seq >= 0:
                self._cond.wait_for(lambda: self._seq > seq, timeout=wait)
                events = [e for e in self._items if e["seq"] > seq]
            else:
                events = []
            return {"events": events, "last": self._seq, "boot": self.boot}


def create_node_app(node: NodeAgent, token: str, name: str = "node",
                    relay: tuple[str, int] | None = None, metrics_token: str = "",
                    relay_tls: ssl.SSLContext | None = None) -> FastAPI:
    """The node API for ``node`` guarded by ``token`` (``GET /metrics``: by ``metrics_token`` when set, else
    open, as in :mod:`sbx.api.observe`). Starting it (its lifespan) starts the node's watcher and,
    with ``relay`` = ``(host, port)``, the port relay there (:mod:`sbx.node.remote.relay`; over TLS with
    ``relay_tls``, a server context that demands a client certificate); stopping it stops both. The API's own TLS
    is the HTTP server's (``sbx node serve`` gives uvicorn the same files)."""
    exits = Exits()
    relay_port = {"port": 0}
    xfer: Any = node  # the transfer calls of sbx.node.migration.transfer (not part of the NodeAgent protocol)
    link = EgressLink()  # the egress proxy asks the polling servers (sbx.node.remote.egresslink)
    node.serve_egress(link.ask)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        node.watch(exits.add)
        server = None
        if relay is not None:
            server = await asyncio.start_server(make_handler(node.address, token), relay[0], relay[1],
                                                ssl=relay_tls)
            relay_port["port"] = server.sockets[0].getsockname()[1]
        try:
            yield
        finally:
            if server is not None:
                server.close()
            node.unwatch()

    app = FastAPI(title="sbx node", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def authorized(header: str | None) -> bool:
        scheme, _, cred = (header or "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(cred.strip().encode(), token.encode())

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Any:
        # the ids of the server's request and sandbox this call serves, for this call's log lines (sbx.logs)
        rid, sid = request.headers.get("x-request-id", ""), request.headers.get("x-sbx-sandbox-id", "")
        with logs.bound(sid if _ID.match(sid) else None, rid if _ID.match(rid) else None):
            return await _checked(request, call_next)

    async def _checked(request: Request, call_next: Any) -> Any:
        if request.url.path.startswith(MIGRATE_PREFIX):  # a migration ticket, checked by the route
            return await call_next(request)
        if request.url.path == "/metrics":  # aggregates only; SBX_METRICS_TOKEN when set (sbx.metrics)
            if not metrics.authorized(request.headers.get("authorization"), metrics_token):
                return _error(401, "unauthorized", "missing or wrong metrics token")
            return Response(metrics.render(), media_type=metrics.CONTENT_TYPE)
        if not authorized(request.headers.get("authorization")):
            return _error(401, "unauthorized", "missing or wrong node token")
        return await call_next(request)

    @app.get("/v1/node/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "node": name, "egress": node.egress_ready()}

    @app.get("/v1/node/exits")
    def exits_after(after: int = -1, wait: float = 20.0, boot: str = "") -> dict[str, Any]:
        return exits.after(after, max(0.0, min(wait, 30.0)), boot)

    @app.get("/v1/node/relay")
    def relay_info() -> dict[str, Any]:
        return dict(relay_port)

    @app.get("/v1/node/transfer/{sid}/{name:path}")
    def export_file(sid: str, name: str, kind: str = "move") -> Any:
        try:
            pieces = xfer.export_file(sid, name, kind)
        except NodeError as e:
            return _error(409, e.code, e.message)
        return StreamingResponse(pieces, media_type="application/octet-stream")

    async def receive(sink: Callable[[Iterator[bytes]], None], what: str, request: Request) -> Any:
        """Feed the request's body to ``sink`` (a file of an import or of a replica) in a worker thread."""
        q: queue.Queue[bytes | None] = queue.Queue(maxsize=32)

        def chunks() -> Iterator[bytes]:
            while (b := q.get()) is not None:
                yield b

        fut = asyncio.get_running_loop().run_in_executor(None, lambda: sink(chunks()))

        async def feed(b: bytes | None) -> None:
            while not fut.done():
                try:
                    q.put_nowait(b)
                    return
                except queue.Full:
                    await asyncio.sleep(0.005)

        try:
            async for b in request.stream():
                if fut.done():
                    break
                if b:
                    await feed(b)
        except Exception as e:  # the sender went away: what arrived is checked (and refused) below
            log.info("%s: body ended early: %s", what, e)
        finally:
            await feed(None)
        try:
            await fut
        except NodeError as e:
            return _error(409, e.code, e.message)
        return {"ok": True}

    @app.put("/v1/node/transfer/{sid}/{name:path}")
    async def import_file(sid: str, name: str, request: Request) -> Any:
        return await receive(lambda chunks: xfer.import_stream(sid, name, chunks), f"import of {sid}/{name}",
                             request)

    @app.put("/v1/node/replica/{sid}/{name:path}")
    async def replica_file(sid: str, name: str, request: Request) -> Any:
        return await receive(lambda chunks: xfer.replica_stream(sid, name, chunks), f"replica of {sid}/{name}",
                             request)

    @app.post("/v1/node/call/{method}")
    def call(method: str, body: dict[str, Any]) -> Any:
        if method not in wire.CALLS:
            return _error(404, "unknown_method", f"the node has no method {method!r}")
        fn = getattr(node, method)
        try:
            args, kwargs = wire.decode(body.get("args", [])), wire.decode(body.get("kwargs", {}))
            inspect.signature(fn).bind(*args, **kwargs)
        except (TypeError, ValueError) as e:
            return _error(400, "bad_call", f"{method}: {e}")
        t0 = time.monotonic()
        named = args[0] if args and isinstance(args[0], str) and _SANDBOX_ID.match(args[0]) else None
        try:
            with logs.bound(named):  # a call about one sandbox names it in its log lines
                return {"result": wire.encode(fn(*args, **kwargs))}
        except NodeError as e:
            return _error(409, e.code, e.message)
        finally:
            metrics.NODE_CALL_SECONDS.labels(call=method).observe(time.monotonic() - t0)

    @app.post("/v1/node/exec")
    async def exec_(body: dict[str, Any]) -> Any:
        try:
            kwargs = wire.decode(body)
            inspect.signature(node.exec).bind(**kwargs)
        except (TypeError, ValueError) as e:
            return _error(400, "bad_call", f"exec: {e}")
        left = threading.Event()
        try:
            events = await run_in_threadpool(lambda: node.exec(**kwargs, stop=left.is_set))
        except NodeError as e:
            return _error(409, e.code, e.message)
        return StreamingResponse(exec_lines(events, left), media_type="application/x-ndjson")

    @app.websocket("/v1/node/spawn")
    async def spawn(ws: WebSocket) -> None:
        if not authorized(ws.headers.get("authorization")):
            await ws.close(code=4401)
            return
        await ws.accept()
        try:
            request = json.loads(await ws.receive_text())
            kwargs = {k: request[k] for k in ("user", "stdin", "tty", "env") if k in request}
            if request.get("size"):
                cols, rows = request["size"]
                kwargs["size"] = (int(cols), int(rows))
            proc = await run_in_threadpool(lambda: node.spawn(str(request["id"]), list(request["argv"]), **kwargs))
        except NodeError as e:
            await ws.send_text(json.dumps({"type": "error", "code": e.code, "message": e.message}))
            await ws.close()
            return
        except (ValueError, KeyError, TypeError, WebSocketDisconnect) as e:
            with contextlib.suppress(Exception):
                await ws.send_text(json.dumps({"type": "error", "code": "bad_call", "message": f"spawn: {e}"}))
                await ws.close()
            return
        await ws.send_text(json.dumps({"type": "started"}))
        await relay_process(ws, proc)

    _migration_routes(app, node)
    egress_routes(app, link)
    image_routes(app, node)
    return app


def _migration_routes(app: FastAPI, node: Any) -> None:
    """The routes of a sandbox arriving from another node (see the module docstring). ``node`` has the
    methods of :class:`sbx.node.migration.incoming.IncomingMixin`."""

    def ticket_ok(request: Request, id: str) -> bool:
        scheme, _, cred = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not _MIGRATE_ID.match(id) or not hasattr(node, "migrate_check_ticket"):
            return False
        return bool(node.migrate_check_ticket(id, cred.strip()))

    def refused() -> JSONResponse:
        return _error(401, "unauthorized", "no such arrival, or a wrong migration ticket")

    @app.put(MIGRATE_PREFIX + "{id}/{stage}")
    async def receive(id: str, stage: str, request: Request) -> Any:
        if not await run_in_threadpool(ticket_ok, request, id):
            return refused()
        try:
            unpacker = await run_in_threadpool(node.migrate_unpacker, id, stage)
        except NodeError as e:
            return _error(400 if e.code == "bad_call" else 409, e.code, e.message)
        try:
            async for chunk in request.stream():
                unpacker.feed(chunk)
            unpacker.close()
        except StreamError as e:
            unpacker.close_quietly()
            return _error(400, "bad_stream", f"{stage}: {e}")
        except OSError as e:
            unpacker.close_quietly()
            return _error(409, "migration_failed", f"{stage}: writing the files: {e}")
        return {"stage": stage, "files": len(unpacker.files), "bytes": sum(unpacker.files.values())}

    def step(method: str) -> Any:
        async def run(id: str, request: Request) -> Any:
            if not await run_in_threadpool(ticket_ok, request, id):
                return refused()
            try:
                got = await run_in_threadpool(getattr(node, method), id)
            except NodeError as e:
                return _error(409, e.code, e.message)
            return got if isinstance(got, dict) else {"ok": bool(got) if got is not None else True}
        return run

    @app.post(MIGRATE_PREFIX + "{id}/pages")
    async def pages(id: str, request: Request) -> Any:
        """A page server for the memory dump, on the address this request came in at, for its sender only."""
        if not await run_in_threadpool(ticket_ok, request, id):
            return refused()
        local, peer = request.scope.get("server"), request.client
        if not local or peer is None:
            return _error(400, "bad_call", "the connection's addresses are unknown")
        try:
            return await run_in_threadpool(node.migrate_pages, id, str(local[0]), str(peer.host))
        except NodeError as e:
            return _error(409, e.code, e.message)

    app.post(MIGRATE_PREFIX + "{id}/restore")(step("migrate_restore"))
    app.post(MIGRATE_PREFIX + "{id}/confirm")(step("migrate_confirm"))
    app.post(MIGRATE_PREFIX + "{id}/abort")(step("migrate_abort"))

    @app.get(MIGRATE_PREFIX + "{id}")
    async def state(id: str, request: Request) -> Any:
        if not await run_in_threadpool(ticket_ok, request, id):
            return refused()
        return {"state": await run_in_threadpool(node.migrate_state, id)}
