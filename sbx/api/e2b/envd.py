"""The "envd" side of the E2B compatibility layer: what E2B's SDK calls *inside* a sandbox, served by the sbx
server itself on behalf of the sandbox (no agent of its own in the guest).

The SDK sends every in-sandbox request to the one ``E2B_SANDBOX_URL`` and names the sandbox in the headers
``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` (49983, envd's port), with ``X-Access-Token`` (the ``envdAccessToken``
the REST API gave it: :func:`sbx.api.e2b.tokens.access_token`). :class:`sbx.api.e2b.mount.Dispatch` sends
requests carrying ``E2b-Sandbox-Id`` here and everything else to sbx's own API, so one port serves both. The
plain-HTTP ``/files`` calls are :class:`sbx.api.e2b.files.FilesRoutes`'s.

Served (envd's contract, ``packages/envd/spec`` in e2b-dev/infra):

- ``GET /health``: 204 while the sandbox runs.
- ``GET /files?path=&username=``: the file's bytes; 404/400 ``{"code","message"}``.
- Signed ``/files`` URLs (``download_url``/``upload_url``: ``signature`` and ``signature_expiration`` in the
  query, no header): the sandbox is the one whose access token verifies the signature.
- ``POST /files?path=&username=``: ``multipart/form-data`` (each ``file`` part; its filename is its path when no
  ``path`` is given) or ``application/octet-stream`` (``Content-Encoding: gzip`` allowed); 200 ``[{"path","name",
  "type":"file"}]``.
- Connect RPCs (:mod:`sbx.api.e2b.connect`, JSON codec): ``process.Process/`` ``Start`` and ``Connect`` (server
  streams), ``StreamInput`` (a client stream), ``List``, ``SendSignal``, ``SendInput``, ``CloseStdin``,
  ``Update`` (a pty's size)
  (:mod:`sbx.api.e2b.procs`);
  ``filesystem.Filesystem/`` ``Stat``, ``ListDir``, ``MakeDir``, ``Move``, ``Remove`` (:mod:`sbx.api.e2b.fs`),
  ``CreateWatcher``, ``GetWatcherEvents``, ``RemoveWatcher`` and the ``WatchDir`` stream
  (:mod:`sbx.api.e2b.watch`).
  Other methods answer ``unimplemented``.

A sandbox that is unknown, deleted, or stopped (E2B: paused) without ``autoResume`` gets E2B's edge answer: 502
``{"sandboxId","message":"The sandbox was not found","code":502}``, which the SDK reads as "not running".
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import sbx.api.e2b.fs as fs
import sbx.api.e2b.ports as ports
import sbx.api.e2b.procs as procs
import sbx.api.e2b.starts as starts
from sbx.api.e2b.connect import (
    STREAM_TYPE,
    ConnectError,
    EnvelopeReader,
    end_frame,
    frame,
    parse_envelopes,
    parse_json,
    unary_error,
)
from sbx.api.e2b.files import USERS, FilesRoutes, http_error
from sbx.api.e2b.pool import Pool
from sbx.api.e2b.tokens import access_token
from sbx.api.e2b.watch import Watchers
from sbx.control.errors import ControlError

if TYPE_CHECKING:
    from sbx.control.service import ControlPlane

log = logging.getLogger("sbx.api.e2b")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ENVD_PORT = 49983
KEEPALIVE_DEFAULT = 50.0
STREAM_INPUT = "process.Process/StreamInput"
"""The one client-streaming call."""
STREAMS = {"process.Process/Start", "process.Process/Connect", "filesystem.Filesystem/WatchDir"}
UNARY = {"process.Process/List", "process.Process/SendSignal", "process.Process/SendInput",
         "process.Process/CloseStdin", "process.Process/Update", "filesystem.Filesystem/Stat",
         "filesystem.Filesystem/ListDir", "filesystem.Filesystem/MakeDir", "filesystem.Filesystem/Move",
         "filesystem.Filesystem/Remove", "filesystem.Filesystem/CreateWatcher",
         "filesystem.Filesystem/GetWatcherEvents", "filesystem.Filesystem/RemoveWatcher"}


def not_found_502(sandbox_id: str) -> JSONResponse:
    """E2B's edge answer for a sandbox that does not run (unknown, killed or paused)."""
    return JSONResponse({"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502},
                        status_code=502)


def basic_user(header: str | None) -> str | None:
    """The user of an ``Authorization: Basic base64("<user>:")`` header (None when there is none or it is not
    Basic); ``""`` for a header that cannot be decoded."""
    if not header:
        return None
    scheme, _, cred = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(cred.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        return ""


class Envd(FilesRoutes):
    """The envd ASGI application for control plane ``cp``; ``secret`` signs access tokens; ``ready`` keeps the
    sandboxes' ready jobs (:mod:`sbx.api.e2b.pool`)."""

    def __init__(self, cp: ControlPlane, secret: bytes, ready: Pool | None = None):
        self.cp = cp
        self.secret = secret
        self.watchers = Watchers()
        self.ready = ready or Pool(cp)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one request named by its ``E2b-Sandbox-Id`` header (see the module's doc)."""
        request = Request(scope, receive)
        port = request.headers.get("e2b-sandbox-port", str(ENVD_PORT))
        if port != str(ENVD_PORT) and request.headers.get("e2b-sandbox-id"):
            await self.forward_port(request, port, scope, receive, send)
            return
        response = await self.handle(request)
        await response(scope, receive, send)

    async def forward_port(self, request: Request, port: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Another port than envd's: forwarded to the sandbox by :mod:`sbx.api.e2b.ports`, or refused there."""
        sid = request.headers.get("e2b-sandbox-id", "")

        def check() -> Response | int:
            gone = self._not_running(sid)
            if gone is not None:
                return gone
            return ports.refusal(self.cp, self.secret, sid, port, request.headers.get("e2b-traffic-access-token", ""))

        try:
            decided = await run_in_threadpool(check)
        except Exception:  # a bug: logged, answered as E2B's edge would rather than a bare 500
            log.exception("unexpected error forwarding port %s of %s", port[:8], sid)
            decided = http_error(502, "internal error; see the server log")
        if isinstance(decided, Response):
            await decided(scope, receive, send)
            return
        await ports.forward(self.cp, sid, decided, scope, receive, send)

    def _not_running(self, sid: str) -> Response | None:
        """E2B's 502 for a sandbox that is unknown, deleted, failed, or stopped without ``autoResume``; None when
        it runs or resumes on demand."""
        row = self.cp.store.get_sandbox(sid) if sid else None
        if row is None or row.state in ("deleted", "deleting", "error") or (
                row.state in ("stopped", "stopping") and not row.auto_resume):
            if row is None or row.state in ("deleted", "deleting"):
                self.watchers.forget(sid)
                self.ready.forget(sid)
            return not_found_502(sid)
        return None

    def _check(self, request: Request) -> tuple[str, Response | None]:
        """The sandbox id, and the answer to give instead of serving (502, 401), if any."""
        sid = request.headers.get("e2b-sandbox-id", "")
        signed = request.url.path == "/files" and "signature" in request.query_params
        if not sid and signed:
            found = self._signed_sandbox(request)
            if isinstance(found, Response):
                return "", found
            sid = found
        gone = self._not_running(sid)
        if gone is not None:
            return sid, gone
        if request.url.path == "/health":
            return sid, None
        given = request.headers.get("x-access-token", "")
        if hmac.compare_digest(given.encode(), access_token(self.secret, sid).encode()):
            return sid, None
        if signed:
            refused = self._signature_refusal(request, access_token(self.secret, sid))
            return sid, refused
        return sid, http_error(401, "missing or wrong X-Access-Token for this sandbox")

    def _signed_sandbox(self, request: Request) -> str | Response:
        """The sandbox a header-less signed ``/files`` URL was made for: the one whose access token verifies its
        signature (401 when none does)."""
        for row in self.cp.store.list_sandboxes():
            if self._signature_refusal(request, access_token(self.secret, row.id), check_expiry=False) is None:
                return row.id
        return http_error(401, "invalid signature")

    @staticmethod
    def _signature_refusal(request: Request, token: str, check_expiry: bool = True) -> Response | None:
        """None when the URL's ``signature`` is the SDK's v1 signature of its path, operation (``read`` for GET,
        ``write`` for POST), ``username`` and ``signature_expiration`` with ``token`` (and not expired); else the
        401 answer."""
        q = request.query_params
        expiration = q.get("signature_expiration")
        parts = [q.get("path", ""), "read" if request.method == "GET" else "write", q.get("username", ""), token]
        if expiration is not None:
            parts.append(expiration)
        digest = hashlib.sha256(":".join(parts).encode()).digest()
        expected = "v1_" + base64.b64encode(digest).rstrip(b"=").decode()
        if not hmac.compare_digest(expected.encode(), q.get("signature", "").encode()):
            return http_error(401, "invalid signature")
        if check_expiry and expiration is not None:
            try:
                expired = int(expiration) < time.time()
            except ValueError:
                return http_error(401, "invalid signature expiration")
            if expired:
                return http_error(401, "signature is already expired")
        return None

    async def handle(self, request: Request) -> Response:
        """Route ``request``; never raises (every failure is an answer; an unexpected one is logged and answered
        503 ``unavailable``)."""
        sid, path = request.headers.get("e2b-sandbox-id", ""), request.url.path
        try:
            sid, refused = await run_in_threadpool(self._check, request)
            if refused is not None:
                return refused
            if path == "/health":
                return Response(status_code=204) if request.method == "GET" else http_error(405, "use GET")
            if path == "/files":
                if request.method == "GET":
                    return await self.download(request, sid)
                if request.method == "POST":
                    return await self.upload(request, sid)
                return http_error(405, "use GET or POST")
            return await self.rpc(request, sid, path.lstrip("/"))
        except ConnectError as e:
            return unary_error(e)
        except ControlError as e:
            return unary_error(procs.control_to_connect(e))
        except Exception as e:  # a bug: logged, answered as the sandbox being unavailable rather than a bare 500
            log.exception("unexpected error serving %s for %s", path, sid)
            return unary_error(ConnectError("unavailable", f"internal error ({type(e).__name__}); see the server "
                                            "log"))

    # Connect ---------------------------------------------------------------------------------------------------
    def _rpc_user(self, request: Request) -> str:
        user = basic_user(request.headers.get("authorization"))
        if user is None:
            return "user"
        if user not in USERS:
            raise ConnectError("permission_denied", f"unknown user {user[:40]!r}: sbx sandboxes have user and root")
        return user

    async def rpc(self, request: Request, sid: str, method: str) -> Response:
        """One Connect call of :data:`STREAMS` or :data:`UNARY`."""
        if request.method != "POST":
            return http_error(405, "Connect calls use POST")
        if method not in STREAMS and method not in UNARY and method != STREAM_INPUT:
            raise ConnectError("unimplemented", f"{method[:80]} is not implemented by sbx")
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        user = self._rpc_user(request)
        if method == STREAM_INPUT:
            if ctype != STREAM_TYPE:
                return http_error(415, f"client-streaming calls take {STREAM_TYPE}")
            return await self._stream_input(request, sid)
        body = await request.body()
        if method in STREAMS:
            if ctype != STREAM_TYPE:
                return http_error(415, f"server-streaming calls take {STREAM_TYPE}")
            try:
                messages = parse_envelopes(body)
                if len(messages) != 1:
                    raise ConnectError("invalid_argument", "a server-streaming call takes exactly one message")
            except ConnectError as e:
                return self._stream_response(request, iter(()), e)
            return self._start_stream(request, sid, method, messages[0], user)
        if ctype != "application/json":
            return http_error(415, "unary calls take application/json")
        message = parse_json(body)
        result = await run_in_threadpool(self._unary, sid, method, message, user)
        return JSONResponse(result)

    async def _stream_input(self, request: Request, sid: str) -> Response:
        """``StreamInput``, a client stream: a ``start`` message naming the process, then ``data`` messages (and
        ``keepalive`` ones), each written to the process's stdin as it arrives; the answer is one ``{}`` and the
        end of stream, or the end of stream with the error that stopped it (what came before it is written)."""
        reader = EnvelopeReader()
        proc: procs.Proc | None = None
        error: ConnectError | None = None
        try:
            async for piece in request.stream():
                for m in reader.feed(piece):
                    if proc is None:
                        start = m.get("start")
                        if not isinstance(start, dict):
                            raise ConnectError("invalid_argument", "the first message must be start {process}")
                        proc = await run_in_threadpool(procs.find, self.cp, sid, start.get("process"))
                    elif isinstance(m.get("data"), dict):
                        data = procs.input_bytes(m["data"].get("input"))
                        if data:
                            await run_in_threadpool(procs.write_input, self.cp, sid, proc, data)
                    elif "keepalive" not in m:
                        raise ConnectError("invalid_argument", "a message after start is data or keepalive")
            reader.close()
            if proc is None:
                raise ConnectError("invalid_argument", "the stream has no start message")
        except ConnectError as e:
            error = e
        except ControlError as e:
            error = procs.control_to_connect(e)
        return Response((frame({}) if error is None else b"") + end_frame(error), media_type=STREAM_TYPE)

    def _unary(self, sid: str, method: str, m: dict[str, Any], user: str) -> dict[str, Any]:
        if method == "process.Process/List":
            return procs.listed(self.cp, sid)
        if method == "process.Process/SendSignal":
            procs.signal(self.cp, sid, m)
            return {}
        if method == "process.Process/SendInput":
            procs.send_input(self.cp, sid, m)
            return {}
        if method == "process.Process/Update":
            procs.resize(self.cp, sid, m)
            return {}
        if method == "process.Process/CloseStdin":
            procs.close_stdin(self.cp, sid, m)
            return {}
        if method == "filesystem.Filesystem/Stat":
            return fs.stat(self.cp, sid, m.get("path"), user)  # type: ignore[arg-type]
        if method == "filesystem.Filesystem/ListDir":
            return fs.list_dir(self.cp, sid, m.get("path"), m.get("depth"), user)  # type: ignore[arg-type]
        if method == "filesystem.Filesystem/MakeDir":
            return fs.make_dir(self.cp, sid, m.get("path"), user)  # type: ignore[arg-type]
        if method == "filesystem.Filesystem/CreateWatcher":
            return self.watchers.create(self.cp, sid, m, user)
        if method == "filesystem.Filesystem/GetWatcherEvents":
            return self.watchers.events(self.cp, sid, m)
        if method == "filesystem.Filesystem/RemoveWatcher":
            return self.watchers.remove(sid, m)
        if method == "filesystem.Filesystem/Move":
            return fs.move(self.cp, sid, m.get("source"), m.get("destination"), user)  # type: ignore[arg-type]
        return fs.remove(self.cp, sid, m.get("path"), user)  # type: ignore[arg-type]

    def _start_stream(self, request: Request, sid: str, method: str, message: dict[str, Any], user: str
                      ) -> Response:
        left = threading.Event()

        if method == "filesystem.Filesystem/WatchDir":
            return self._stream_response(request, self.watchers.stream(self.cp, sid, message, user, left.is_set),
                                         None, left, wrap=False)

        def events() -> Iterator[dict[str, Any]]:
            if method == "process.Process/Start":
                yield from starts.start(self.cp, self.ready, sid, procs.launch_spec(message, user), left)
            else:
                proc = procs.find(self.cp, sid, message.get("process"))
                yield from procs.follow(self.cp, sid, proc.job, True, left.is_set, pty=proc.pty)

        return self._stream_response(request, events(), None, left)

    def _stream_response(self, request: Request, events: Iterator[dict[str, Any]], error: ConnectError | None,
                         left: threading.Event | None = None, wrap: bool = True) -> StreamingResponse:
        """A 200 ``application/connect+json`` stream of ``{"event": ...}`` envelopes (the messages as they are
        without ``wrap``: ``WatchDirResponse`` has its oneof at the top), keepalives when nothing else came for
        ``Keepalive-Ping-Interval`` seconds, and the end-of-stream envelope (with the error that ended it, if
        any: ``deadline_exceeded`` once ``Connect-Timeout-Ms`` has passed)."""
        left = left or threading.Event()
        try:
            every = float(request.headers.get("keepalive-ping-interval", KEEPALIVE_DEFAULT))
        except ValueError:
            every = KEEPALIVE_DEFAULT
        every = min(max(every, 1.0), 3600.0)
        limit = request.headers.get("connect-timeout-ms", "")
        seconds = int(limit) / 1000 if limit.isdigit() and len(limit) <= 10 and int(limit) > 0 else None

        async def body() -> AsyncIterator[bytes]:
            if error is not None:
                yield end_frame(error)
                return
            queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
            loop = asyncio.get_running_loop()

            def pump() -> None:
                try:
                    for ev in events:
                        loop.call_soon_threadsafe(queue.put_nowait, ("event", ev))
                    loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
                except ConnectError as e:
                    loop.call_soon_threadsafe(queue.put_nowait, ("end", e))
                except ControlError as e:
                    loop.call_soon_threadsafe(queue.put_nowait, ("end", procs.control_to_connect(e)))
                except Exception as e:  # never a broken stream without its end frame
                    loop.call_soon_threadsafe(queue.put_nowait, ("end", ConnectError("unavailable", repr(e))))

            worker = loop.run_in_executor(None, pump)
            deadline = loop.time() + seconds if seconds is not None else None
            try:
                while True:
                    wait = every
                    if deadline is not None:
                        wait = min(wait, deadline - loop.time())
                        if wait <= 0:  # the call's deadline: the stream ends, the process goes on (as in envd)
                            yield end_frame(ConnectError("deadline_exceeded", "the call's deadline passed"))
                            return
                    try:
                        kind, item = await asyncio.wait_for(queue.get(), timeout=wait)
                    except TimeoutError:
                        if deadline is not None and loop.time() >= deadline:
                            continue
                        yield frame({"event": {"keepalive": {}}} if wrap else {"keepalive": {}})
                        continue
                    if kind == "event":
                        yield frame({"event": item} if wrap else item)
                        continue
                    yield end_frame(item)
                    return
            finally:
                left.set()
                del worker  # it ends on its own once the follower sees ``left``

        return StreamingResponse(body(), media_type=STREAM_TYPE)
