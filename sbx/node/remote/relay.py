"""The node's port relay (issue 10): how a server's port proxy reaches a hosted port of a sandbox on this node.

A sandbox's address lives on its node's bridge, which only that node's host can reach; the server's proxy
(:mod:`sbx.api.proxy`) therefore opens a TCP connection to the relay (``node_port + 1``, on the node API's
address) and sends one line::

    SBXRELAY <node token> <sandbox id> <port>\\n

The relay checks the token (constant time), looks up that sandbox's own address on this node and connects to
``address:port``; it answers ``OK\\n`` and then copies bytes both ways until either side closes, or ``ERR <code>
<message>\\n`` and closes (``unauthorized``, ``bad_request``, ``not_found``, ``not_running``, ``unreachable``).
It never connects anywhere but a sandbox address of this node, and it listens where the node API does, which
sandboxes cannot reach (the egress policy drops private addresses: ``tests/e2e/nodes/test_nodes.py`` attacks it).
A node that serves its API over mutual TLS (:mod:`sbx.tls`) serves the relay the same way: the hello line and the
bytes that follow cross inside TLS, and a client without a certificate of the installation CA is refused before it
can send anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import select
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable

from sbx.node.types import NodeError

log = logging.getLogger("sbx.node.remote")

SANDBOX_ID = re.compile(r"^sb_[a-z0-9]{10}$")
HELLO_LIMIT = 512


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if dst.can_write_eof():
                dst.write_eof()


async def pipe_both(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                    b: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
    """Copy bytes ``a`` -> ``b`` and ``b`` -> ``a`` until both directions ended; then close both writers."""
    try:
        await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))
    finally:
        for w in (a[1], b[1]):
            with contextlib.suppress(Exception):
                w.close()


def make_handler(address: Callable[[str], str], token: str) -> Callable[
        [asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """The connection handler of a relay for sandboxes whose addresses ``address(id)`` gives (a
    :meth:`sbx.node.types.NodeAgent.address`; run in a thread), guarded by the node ``token``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def refuse(code: str, message: str) -> None:
            with contextlib.suppress(Exception):
                writer.write(f"ERR {code} {message}\n".encode())
                await writer.drain()
                writer.close()

        try:
            line = await asyncio.wait_for(reader.readuntil(b"\n"), 10)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            await refuse("bad_request", "no hello line")
            return
        parts = line[:HELLO_LIMIT].decode(errors="replace").split()
        if len(parts) != 4 or parts[0] != "SBXRELAY":
            await refuse("bad_request", "expected: SBXRELAY <token> <sandbox id> <port>")
            return
        if not secrets.compare_digest(parts[1].encode(), token.encode()):
            await refuse("unauthorized", "missing or wrong node token")
            return
        sid, port_s = parts[2], parts[3]
        if not SANDBOX_ID.match(sid) or not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
            await refuse("bad_request", "bad sandbox id or port")
            return
        try:
            addr = await asyncio.to_thread(address, sid)
        except NodeError as e:
            await refuse(e.code, e.message)
            return
        try:
            up = await asyncio.wait_for(asyncio.open_connection(addr, int(port_s)), 10)
        except (TimeoutError, OSError) as e:
            await refuse("unreachable", f"{type(e).__name__}: {e}")
            return
        writer.write(b"OK\n")
        await writer.drain()
        await pipe_both((reader, writer), up)

    return handle


async def open_relay(host: str, port: int, token: str, tls: ssl.SSLContext | None, sandbox_id: str, sandbox_port: int,
                     timeout: float = 10.0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``sandbox_port`` of ``sandbox_id`` through the relay at ``host:port`` (the server's
    side; ``tls``: the client context when the node is reached over TLS). Raises ``NodeError`` with the relay's
    code (``node_unreachable`` when the relay can't be reached or the TLS handshake fails)."""
    try:
        if tls is None:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        else:
            reader, writer = await _tls_bridge(host, port, tls, timeout)
        writer.write(f"SBXRELAY {token} {sandbox_id} {sandbox_port}\n".encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.readuntil(b"\n"), timeout)
    except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:  # ssl.SSLError too
        raise NodeError("node_unreachable", f"the port relay at {host}:{port}: {type(e).__name__}: {e}") from None
    if answer != b"OK\n":
        _, code, message = (answer.decode(errors="replace").strip().split(" ", 2) + ["", ""])[:3]
        writer.close()
        raise NodeError(code or "unreachable", message or "the relay refused")
    return reader, writer


async def _tls_bridge(host: str, port: int, tls: ssl.SSLContext, timeout: float
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TLS connection to ``host:port`` (checked with ``tls`` against ``host``) as asyncio streams: the handshake
    and the encryption run in a thread of their own (:func:`_pump_tls`) that copies between the TLS socket and one
    end of a socket pair, whose other end the streams read and write. The server's event loop never holds an
    asyncio SSL transport: under the hosted-port proxy's load (a client looping through a relay while its sandbox
    moved) those crashed the interpreter here (a segfault in garbage collection, Python 3.11). Raises
    ``OSError`` (``ssl.SSLError``: the handshake failed), ``TimeoutError``."""

    def connect() -> ssl.SSLSocket:
        raw = socket.create_connection((host, port), timeout=timeout)
        try:
            return tls.wrap_socket(raw, server_hostname=host)
        except BaseException:
            raw.close()
            raise

    secure = await asyncio.wait_for(asyncio.to_thread(connect), timeout + 1)
    ours, theirs = socket.socketpair()
    threading.Thread(target=_pump_tls, args=(secure, theirs), name=f"relay-tls-{host}:{port}", daemon=True).start()
    return await asyncio.open_connection(sock=ours)


def _pump_tls(secure: ssl.SSLSocket, plain: socket.socket) -> None:
    """Copy bytes both ways between ``secure`` (non-blocking, so a TLS record that is not application data, as a
    TLS 1.3 session ticket, never holds the other direction) and ``plain`` until either side ends; closes both.
    One thread per connection: an SSL object is never used by two threads at once."""
    secure.setblocking(False)
    pending = b""  # read from plain, not yet taken by secure
    try:
        while True:
            readers: list[socket.socket] = [secure] if pending else [secure, plain]
            ready = [secure] if secure.pending() else select.select(readers, [secure] if pending else [], [], 60)[0]
            if secure in ready:
                try:
                    data = secure.recv(1 << 16)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    data = None
                if data == b"":
                    return
                if data:
                    plain.sendall(data)
            if plain in ready:
                pending = plain.recv(1 << 16)
                if not pending:
                    return
            if pending:
                try:
                    pending = pending[secure.send(pending):]
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    pass
    except OSError:  # either side reset
        return
    finally:
        for s in (secure, plain):
            with contextlib.suppress(OSError):
                s.close()
