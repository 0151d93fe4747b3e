"""E2B's port forwarding through ``E2B_SANDBOX_URL``: a request with ``E2b-Sandbox-Id`` and an
``E2b-Sandbox-Port`` other than envd's (49983) goes to that port of the sandbox, as E2B's edge sends it. This is
how ``e2b-code-interpreter`` reaches its Jupyter server on port 49999 (``images/code-interpreter``).

The rule is the one E2B's names of ports follow on the hosted-port proxy (:mod:`sbx.api.e2b.hosts`): a sandbox
created through E2B's API has every port public (E2B's default), or, created with ``network.allowPublicTraffic``
false, reached with its ``trafficAccessToken`` in ``E2B-Traffic-Access-Token``; a sandbox made with sbx's own API
forwards nothing this way (its ports are reached once hosted, on the proxy). Answers of its own are E2B's edge
answers: 502 ``{"sandboxId","message","code"}`` for a sandbox that does not run or a port nothing listens on, 401
for a missing or wrong traffic token, 400 for a port that is no port.

The request and the response stream through (HTTP/1.1 to the sandbox, parsed with h11), so a streamed answer such
as code-interpreter's ``/execute`` arrives line by line; a client that goes away closes the connection to the
sandbox, so the server there sees it leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING

import h11
from starlette.responses import JSONResponse

import sbx.api.e2b.lifecycle as lifecycle
from sbx.api.e2b.tokens import traffic_token
from sbx.api.upstream import Unreachable, open_upstream
from sbx.control.store.database import as_utc

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

    from sbx.control.service import ControlPlane

CHUNK = 64 * 1024
STATE_EVERY = 2.0
"""Seconds of silence from the sandbox between two looks at its state (:func:`_exchange`)."""
BOOT_WINDOW = 60.0
BOOT_WAIT = 20.0
"""A port that refuses connections in the first :data:`BOOT_WINDOW` seconds after its sandbox started running is
tried again for up to :data:`BOOT_WAIT` seconds: a sandbox's create answers once systemd runs, before its services
(such as the code-interpreter's server) listen. Later, a refused connection is answered at once."""
_DROPPED = {b"host", b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
            b"upgrade", b"e2b-sandbox-id", b"e2b-sandbox-port", b"e2b-traffic-access-token", b"x-access-token"}
"""Request headers not passed on: hop-by-hop ones, and E2B's own (the tokens never reach the sandbox)."""


def _edge(sandbox_id: str, status: int, message: str) -> JSONResponse:
    return JSONResponse({"sandboxId": sandbox_id, "message": message, "code": status}, status_code=status)


def refusal(cp: ControlPlane, secret: bytes, sandbox_id: str, port: str, traffic: str) -> JSONResponse | int:
    """The port number to forward to, or the answer refusing it (see the module's doc); ``traffic`` is the
    request's ``E2B-Traffic-Access-Token``. The sandbox's state was checked already (it exists and is running or
    resumes on demand)."""
    if not port.isdigit() or not 0 < int(port) < 65536:
        return _edge(sandbox_id, 400, f"E2b-Sandbox-Port {port[:8]!r} is not a port number")
    row = cp.store.get_sandbox(sandbox_id)
    mode = (row.labels or {}).get(lifecycle.PORTS) if row is not None else None
    if row is None or mode not in (lifecycle.PUBLIC, lifecycle.TRAFFIC_TOKEN):
        return _edge(sandbox_id, 502, f"port {port} of sandbox {sandbox_id} is not reachable through "
                     "E2B_SANDBOX_URL: only sandboxes created through E2B's API forward their ports (host it with "
                     "sbx host to reach it on the hosted-port proxy)")
    if mode == lifecycle.TRAFFIC_TOKEN and not hmac.compare_digest(
            traffic.encode(), traffic_token(secret, sandbox_id).encode()):
        what = "a wrong" if traffic else "no"
        return _edge(sandbox_id, 401, f"this sandbox's ports need its traffic access token; the request has {what} "
                     "E2B-Traffic-Access-Token")
    return int(port)


async def forward(cp: ControlPlane, sandbox_id: str, port: int, scope: Scope, receive: Receive, send: Send) -> None:
    """Forward one ASGI HTTP request to ``port`` of sandbox ``sandbox_id`` and stream its answer back (the
    caller checked :func:`refusal`). Counts as the sandbox's activity while it lasts."""
    cp.activity.begin(sandbox_id)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BOOT_WAIT
        while True:
            try:
                reader, writer = await open_upstream(cp, sandbox_id, port)
                break
            except Unreachable as e:
                if e.refused and loop.time() < deadline and await asyncio.to_thread(_booting, cp, sandbox_id):
                    await asyncio.sleep(0.2)  # its services are still starting: E2B's edge waits for them too
                    continue
                status = e.status if e.status in (403, 404) else 502
                await _edge(sandbox_id, status, e.message)(scope, receive, send)
                return
        def running() -> bool:
            row = cp.store.get_sandbox(sandbox_id)
            return row is not None and row.state == "running"

        try:
            await _exchange(scope, receive, send, reader, writer, port, running)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    finally:
        cp.activity.end(sandbox_id)


def _booting(cp: ControlPlane, sandbox_id: str) -> bool:
    """Whether the sandbox started running (created or resumed) less than :data:`BOOT_WINDOW` seconds ago."""
    row = cp.store.get_sandbox(sandbox_id)
    if row is None or row.state != "running":
        return False
    return (dt.datetime.now(dt.UTC) - as_utc(row.updated_at)).total_seconds() < BOOT_WINDOW


async def _exchange(scope: Scope, receive: Receive, send: Send, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter, port: int, running: Callable[[], bool]) -> None:
    """Send the request, stream the answer. While the sandbox is silent, every :data:`STATE_EVERY` seconds
    ``running()`` is asked: once the sandbox is stopped or deleted the answer ends unfinished, so the client sees
    its connection broken, as on E2B (a killed sandbox's connections never close by themselves: its network is
    gone)."""
    conn = h11.Connection(h11.CLIENT)
    headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in _DROPPED]
    headers.append((b"host", f"localhost:{port}".encode()))
    if not any(k.lower() == b"content-length" for k, _ in headers):
        headers.append((b"transfer-encoding", b"chunked"))
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    writer.write(conn.send(h11.Request(method=scope["method"], target=target, headers=headers)) or b"")
    gone = asyncio.Event()

    async def client_to_sandbox() -> None:
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
                return
            if message.get("body"):
                writer.write(conn.send(h11.Data(data=message["body"])) or b"")
                await writer.drain()
            more = message.get("more_body", False)
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    sending = asyncio.create_task(client_to_sandbox())
    started = False
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                reading = asyncio.ensure_future(reader.read(CHUNK))
                waiting = asyncio.ensure_future(gone.wait())
                read = False
                while True:
                    finished, _ = await asyncio.wait({reading, waiting}, timeout=STATE_EVERY,
                                                     return_when=asyncio.FIRST_COMPLETED)
                    if finished:
                        read = reading in finished
                        break
                    if not await asyncio.to_thread(running):
                        break  # the sandbox was stopped or killed: end unfinished
                if not read:  # the client left, or the sandbox: close the connection to it
                    reading.cancel()
                    waiting.cancel()
                    return
                waiting.cancel()
                conn.receive_data(reading.result())
                continue
            if isinstance(event, h11.Response):
                started = True
                kept = [(k, v) for k, v in event.headers if k.lower() not in (b"connection", b"transfer-encoding",
                                                                              b"keep-alive")]
                await send({"type": "http.response.start", "status": event.status_code, "headers": kept})
            elif isinstance(event, h11.Data):
                await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
    except (h11.RemoteProtocolError, ConnectionError) as e:
        if not started:
            await _edge("", 502, f"port {port} of the sandbox answered no HTTP ({type(e).__name__})")(
                scope, receive, send)
    finally:
        sending.cancel()
        with contextlib.suppress(BaseException):
            await sending
