"""The hosted-port proxy: an HTTP/1.1 listener (``settings.proxy_port``) that routes by ``Host`` header.

``Host: <port>-<subdomain>.<domain>`` reaches ``<port>`` of the sandbox with that subdomain, at its address on the
node's bridge, when the sandbox has a route for that port (:mod:`sbx.control.sandboxes.routes`). E2B's SDK's name
of the same port, ``<port>-<E2B sandboxID>.<domain>`` (``Sandbox.get_host``), is another name of that route
(:func:`sbx.api.e2b.hosts.native_host`); for a sandbox made through E2B's API it also reaches its ports no route
hosts, as E2B does (:func:`sbx.api.e2b.hosts.unhosted_route`). In production a TLS
terminator for ``*.<domain>`` forwards to this listener.

Per connection the proxy reads one request head (parsed with h11), decides, then pipes bytes both ways, so bodies
and responses of any size stream through and a WebSocket upgrade (or any other protocol switch) just works:

- unknown host or no route: ``404 not_found``; a private route without its token: ``401 unauthorized`` (never a
  redirect). The token comes from the ``X-Sbx-Token`` header, a ``token`` query parameter, or the ``sbx_token``
  cookie. A ``?token=`` is removed from the forwarded URL and answered with an HttpOnly ``Set-Cookie`` on the first
  response, so a browser can follow links. The token header and cookie are never forwarded to the sandbox.
- a stopped sandbox with ``autoResume`` is resumed first, then served; otherwise ``409 not_running`` with its
  state (a suspended account's: ``403 account_suspended``). Nothing listening on the port: ``502
  upstream_unreachable``. A host of a deleted account's sandbox: ``401 unauthorized`` (issue 36).
- every connection counts as activity for the sandbox's TTL while it is open.

One request per connection: a plain request is forwarded with ``Connection: close`` (and the response gets it
too), so each request is routed and checked on its own; upgraded connections stay open until either side ends.
Errors are JSON ``{"error": {"code","message"[,"state"]}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import h11

from sbx.api.e2b.hosts import TRAFFIC_HEADER, native_host, unhosted_route
from sbx.api.sessions import SESSION_COOKIE
from sbx.api.upstream import Unreachable, open_upstream
from sbx.config import Settings
from sbx.control.service import ControlPlane

log = logging.getLogger("sbx.proxy")

TOKEN_HEADER = b"x-sbx-token"
COOKIE = "sbx_token"
HEAD_LIMIT = 64 * 1024
HEAD_TIMEOUT = 30.0
PIPE_CHUNK = 64 * 1024
_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer"}


def _error(status: int, code: str, message: str, state: str | None = None, extra: bytes = b"") -> bytes:
    body: dict[str, Any] = {"code": code, "message": message}
    if state is not None:
        body["state"] = state
    data = json.dumps({"error": body}).encode()
    reason = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 409: "Conflict",
              502: "Bad Gateway", 503: "Service Unavailable"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
            "connection: close\r\n").encode() + extra + b"\r\n" + data


def _strip_token(target: bytes) -> tuple[bytes, str | None]:
    """Remove ``token`` from the query of ``target``; returns the new target and the token (or None)."""
    parts = urlsplit(target.decode("latin-1"))
    if not parts.query:
        return target, None
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    tokens = [v for k, v in pairs if k == "token"]
    if not tokens:
        return target, None
    rest = urlencode([(k, v) for k, v in pairs if k != "token"])
    return urlunsplit(("", "", parts.path, rest, parts.fragment)).encode("latin-1"), tokens[-1]


def _split_cookies(values: list[bytes]) -> tuple[list[bytes], str | None]:
    """Drop our cookie from ``Cookie`` header values; returns the values left and our cookie's value. The web
    console's session cookie (:data:`sbx.api.sessions.SESSION_COOKIE`, sent along when the console and the proxy share
    a host name) is dropped too and never read: a hosted port neither sees nor accepts it."""
    ours = None
    kept = []
    for raw in values:
        pieces = []
        for piece in raw.split(b";"):
            name, _, value = piece.strip().partition(b"=")
            if name == COOKIE.encode():
                ours = value.decode("latin-1")
            elif name == SESSION_COOKIE.encode():
                continue
            elif piece.strip():
                pieces.append(piece.strip())
        if pieces:
            kept.append(b"; ".join(pieces))
    return kept, ours


def _with_response_headers(head: bytes, add: list[bytes], close: bool) -> bytes:
    """Rewrite an upstream response head: drop hop-by-hop headers (unless it is a 101), add ``add`` lines."""
    lines = head.split(b"\r\n")
    status_line, headers = lines[0], [h for h in lines[1:] if h]
    upgrade = b" 101" in status_line[:13]
    if close and not upgrade:
        headers = [h for h in headers if h.split(b":", 1)[0].strip().lower() not in _HOP]
        headers.append(b"Connection: close")
    return b"\r\n".join([status_line, *headers, *add]) + b"\r\n\r\n"


class Proxy:
    """The listener. ``control`` resolves routes and resumes sandboxes; ``settings.proxy_port`` and
    ``settings.host`` say where to listen (:meth:`start`)."""

    def __init__(self, control: ControlPlane, settings: Settings):
        self.control = control
        self.settings = settings
        self.server: asyncio.Server | None = None

    async def start(self, host: str | None = None, port: int | None = None) -> None:
        """Listen on ``host:port`` (default ``settings.host:settings.proxy_port``)."""
        self.server = await asyncio.start_server(self._handle, host or self.settings.host,
                                                 port if port is not None else self.settings.proxy_port)

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        active: list[str] = []
        try:
            await self._serve(reader, writer, active)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except Exception:
            log.exception("proxy connection failed")
            with contextlib.suppress(Exception):
                writer.write(_error(502, "proxy_error", "the proxy failed on this request"))
        finally:
            for sid in active:
                self.control.activity.end(sid)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[h11.Request, bytes] | bytes:
        """Parse one request head; returns it with the bytes read past it, or an error answer."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:
                return _error(400, "bad_request", f"malformed HTTP request: {e}")
            if isinstance(event, h11.Request):
                rest, _ = conn.trailing_data
                return event, bytes(rest)
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(reader.read(PIPE_CHUNK), HEAD_TIMEOUT)
                conn.receive_data(data)
                if not data:
                    raise ConnectionError("closed before a request")
                continue
            return _error(400, "bad_request", "expected an HTTP request")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, active: list[str]) -> None:
        """Answer one request on a client connection; ``active`` gets the sandbox id once the connection counts as
        its activity (the caller ends it)."""
        parsed = await self._read_head(reader)
        if isinstance(parsed, bytes):
            writer.write(parsed)
            await writer.drain()
            return
        req, rest = parsed
        headers = [(k.lower(), v) for k, v in req.headers.raw_items()]
        host = next((v for k, v in headers if k == b"host"), b"").decode("latin-1")
        cp = self.control
        # E2B's name of a port (sbx.api.e2b.hosts) is another name of the same route: same checks, same tokens
        name = await asyncio.to_thread(native_host, cp, host) or host
        found = await asyncio.to_thread(cp.routes.resolve, name)
        if found is None:  # E2B's name of a port of a sandbox made through E2B's API: E2B's rule (sbx.api.e2b.hosts)
            found = await asyncio.to_thread(unhosted_route, cp, host)
        if found is None:
            if await asyncio.to_thread(cp.routes.account_ended, name):  # issue 36: its tokens open nothing now
                writer.write(_error(401, "unauthorized", "the account of this hosted port was deleted; its port "
                                    "tokens no longer open anything"))
                await writer.drain()
                return
            writer.write(_error(404, "not_found", f"no hosted port at {host or '(no Host header)'}"))
            await writer.drain()
            return
        sandbox, route = found.sandbox, found.route

        target, query_token = _strip_token(req.target)
        cookie_values, cookie_token = _split_cookies([v for k, v in headers if k == b"cookie"])
        header_token = next((v.decode("latin-1") for k, v in headers if k in (TOKEN_HEADER, TRAFFIC_HEADER)), None)
        set_cookie: list[bytes] = []
        if not route.public:
            given = [t for t in (header_token, query_token, cookie_token) if t]
            if not any(secrets.compare_digest(t.encode(), route.token.encode()) for t in given):
                what = "a wrong token" if given else "no token"
                writer.write(_error(401, "unauthorized", f"port {route.port} of this sandbox is private and the "
                                    f"request has {what} (X-Sbx-Token header or ?token=)"))
                await writer.drain()
                return
            if query_token and secrets.compare_digest(query_token.encode(), route.token.encode()):
                cookie = SimpleCookie()
                try:
                    cookie[COOKIE] = route.token
                    cookie[COOKIE]["httponly"] = True
                    cookie[COOKIE]["path"] = "/"
                    cookie[COOKIE]["samesite"] = "Lax"
                    set_cookie.append(cookie.output(header="Set-Cookie:").encode("latin-1"))
                except CookieError:
                    pass

        cp.activity.begin(sandbox.id)
        active.append(sandbox.id)
        try:
            up_reader, up_writer = await open_upstream(cp, sandbox.id, route.port)
        except Unreachable as e:
            writer.write(_error(e.status, e.code, e.message, e.state))
            await writer.drain()
            return

        upgrade = any(k == b"upgrade" for k, _ in headers)
        out = [req.method + b" " + target + b" HTTP/1.1"]
        for k, v in req.headers.raw_items():
            lk = k.lower()
            if lk in (TOKEN_HEADER, TRAFFIC_HEADER, b"cookie") or lk.startswith(b"x-forwarded-"):
                continue
            if not upgrade and lk in _HOP:
                continue
            out.append(k + b": " + v)
        out += [b"Cookie: " + c for c in cookie_values]
        peer = writer.get_extra_info("peername")
        out.append(b"X-Forwarded-For: " + (str(peer[0]).encode() if peer else b"unknown"))
        out.append(b"X-Forwarded-Host: " + host.encode("latin-1"))
        out.append(b"X-Forwarded-Proto: " + next((v for k, v in headers if k == b"x-forwarded-proto"), b"http"))
        if not upgrade:
            out.append(b"Connection: close")
        up_writer.write(b"\r\n".join(out) + b"\r\n\r\n" + rest)
        await up_writer.drain()

        async def upstream_to_client() -> None:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = await up_reader.read(PIPE_CHUNK)
                if not chunk:
                    writer.write(head)
                    return
                head += chunk
                if len(head) > HEAD_LIMIT:
                    break
            end = head.find(b"\r\n\r\n")
            if end < 0:
                writer.write(head)
            else:
                writer.write(_with_response_headers(head[:end], set_cookie, close=not upgrade) + head[end + 4:])
            await writer.drain()
            await _pipe(up_reader, writer)

        async def client_to_upstream() -> None:
            await _pipe(reader, up_writer)

        tasks = [asyncio.create_task(upstream_to_client()), asyncio.create_task(client_to_upstream())]
        try:
            # the answer decides: once the upstream has finished, the exchange is over
            await tasks[0]
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t
            up_writer.close()
            with contextlib.suppress(Exception):
                await up_writer.wait_closed()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy ``src`` to ``dst`` until EOF, then half-close ``dst`` (if it can)."""
    try:
        while chunk := await src.read(PIPE_CHUNK):
            dst.write(chunk)
            await dst.drain()
    finally:
        if dst.can_write_eof():
            with contextlib.suppress(Exception):
                dst.write_eof()
