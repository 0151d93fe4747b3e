"""Receiving a live migration's memory pages while the source dumps them: a one-connection CRIU page server.

The source dumps with ``runc checkpoint --page-server ADDR:PORT``: CRIU then sends the pages (``pagemap-*.img``,
``pages-*.img``) over TCP to a ``criu page-server`` as it reads them, while the other, small images stay in the
source's image folder; so the dump and the transfer of the memory overlap instead of following each other. CRIU's
page server has no authentication of its own, so :class:`PageReceiver` listens itself (one socket on the address
the source reached this node at, an ephemeral port), accepts a connection only from the source's address (others
are closed at once), and hands the accepted socket to ``criu page-server --ps-socket FD``, which writes the pages
into ``folder`` and exits when the dump is done (measured here: 128 MiB dumped and received in 0.37 s).

Between nodes that talk mutual TLS (:mod:`sbx.tls`) the pages cross inside TLS too (issue 35): CRIU's own
``--tls`` can't be given through ``runc checkpoint``, so both ends tunnel instead. On the destination,
:class:`PageReceiver` with ``tls`` (a server context demanding a client certificate of the installation CA) does
the TLS handshake on the accepted connection and hands CRIU one end of a socket pair, relaying between the two; on
the source, :class:`PageSender` listens on loopback for the dumping CRIU's one connection and relays it into a TLS
connection to the receiver (checking the destination's certificate against the node's host name).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

from sbx.runtime.base import RuntimeError_
from sbx.runtime.criu import log_tail

log = logging.getLogger("sbx.runtime")

ACCEPT_TIMEOUT = 120.0
"""Seconds the receiver waits for the source's CRIU to connect before it gives up."""


class PageReceiver:
    """One arrival's page server: listens on ``address`` (an ephemeral port, :attr:`port`) for one connection from
    ``peer`` (an IPv4 address), then runs ``criu`` (the wrapper's path) ``page-server`` on it, writing into
    ``folder`` (made 0700) with its log in ``work_dir``. Raises ``OSError`` when it can't listen."""

    def __init__(self, criu: Path, folder: Path, work_dir: Path, address: str, peer: str,
                 tls: ssl.SSLContext | None = None):
        """``tls``: a server context; the source's connection must then be TLS with a certificate it accepts."""
        self.criu, self.folder, self.work_dir, self.peer, self.tls = criu, folder, work_dir, peer, tls
        self._conn: socket.socket | None = None
        for d in (folder, work_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind((address, 0))
            self._sock.listen(4)
        except OSError:
            self._sock.close()
            raise
        self.address, self.port = self._sock.getsockname()[:2]
        self._proc: subprocess.Popen[bytes] | None = None
        self._error: str | None = None
        self._stopped = False
        self._guard = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"page-server-{self.port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        deadline = time.monotonic() + ACCEPT_TIMEOUT
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._error = f"the source did not connect within {ACCEPT_TIMEOUT:g} s"
                    return
                self._sock.settimeout(left)
                conn, (host, _port) = self._sock.accept()
                if host == self.peer:
                    break
                log.warning("page server %s:%s: refused a connection from %s (waiting for %s)", self.address,
                            self.port, host, self.peer)
                conn.close()
            conn.setblocking(True)
            if self.tls is None:
                with conn, self._guard:
                    if self._stopped:
                        return
                    self._proc = self._criu(conn)
                return
            self._conn = conn
            ours, criu_end = socket.socketpair()
            with conn, ours:
                with criu_end, self._guard:
                    if self._stopped:
                        return
                    self._proc = self._criu(criu_end)
                asyncio.run(_relay(conn, ours, self.tls, server_side=True))
        except TimeoutError:
            self._error = f"the source did not connect within {ACCEPT_TIMEOUT:g} s"
        except OSError as e:  # the listening socket was closed by stop()
            if not self._stopped:
                self._error = f"waiting for the source: {e}"
        finally:
            self._sock.close()

    def _criu(self, conn: socket.socket) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [str(self.criu), "page-server", "--images-dir", str(self.folder), "--work-dir",
             str(self.work_dir), "-o", "page-server.log", "--ps-socket", str(conn.fileno())],
            pass_fds=[conn.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)

    def wait(self, timeout: float) -> None:
        """Wait until the page server received the whole dump and exited. Raises :class:`RuntimeError_`
        (``"page-server"``) when the source never connected, CRIU failed (its log's last lines), or it takes
        longer than ``timeout`` seconds (it is killed)."""
        deadline = time.monotonic() + timeout
        self._thread.join(timeout)
        if self._error or self._proc is None:
            self.stop()
            raise RuntimeError_("page-server", self._error or "the source did not connect")
        try:
            code = self._proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as e:
            self.stop()
            raise RuntimeError_("page-server", f"not done after {timeout:.0f} s") from e
        if code != 0:
            raise RuntimeError_("page-server", f"criu page-server exited {code}\n"
                                               f"{log_tail(self.work_dir, 'page-server.log')}")

    def stop(self) -> None:
        """Stop listening and kill the page server if it runs (an aborted arrival). Idempotent."""
        with self._guard:
            self._stopped = True
            proc = self._proc
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._conn is not None:  # ends the TLS relay
            with contextlib.suppress(OSError):
                self._conn.shutdown(socket.SHUT_RDWR)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


class PageSender:
    """The source's end of a page stream in TLS: listens on ``127.0.0.1`` (an ephemeral port; :attr:`address` is
    ``"127.0.0.1:PORT"`` for ``runc checkpoint --page-server``), takes the dumping CRIU's one connection and relays
    it into a TLS connection to ``host:port`` (the destination's :class:`PageReceiver`), checking its certificate
    with ``tls`` (a client context) against ``server_name``. Raises ``OSError`` when it can't listen."""

    def __init__(self, host: str, port: int, server_name: str, tls: ssl.SSLContext):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.bind(("127.0.0.1", 0))
            self._sock.listen(1)
        except OSError:
            self._sock.close()
            raise
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.error: str | None = None
        self._target, self._name, self._tls = (host, port), server_name, tls
        self._thread = threading.Thread(target=self._serve, name=f"page-sender-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._sock.settimeout(ACCEPT_TIMEOUT)
            conn, _ = self._sock.accept()
        except OSError as e:  # closed by close(), or CRIU never came
            self.error = f"CRIU did not connect: {e}"
            return
        finally:
            self._sock.close()
        with conn:
            conn.setblocking(True)
            try:
                asyncio.run(_relay(conn, None, self._tls, server_side=False, target=self._target,
                                   server_name=self._name))
            except (OSError, ssl.SSLError) as e:
                self.error = f"the TLS page stream to {self._target[0]}:{self._target[1]}: {e}"
                log.warning("page sender: %s", self.error)

    def close(self, timeout: float = 30.0) -> None:
        """Stop listening and wait up to ``timeout`` seconds for the relay to end (CRIU closes its side when the
        dump is done; 0: don't wait). Idempotent."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout)


async def _relay(plain: socket.socket, other: socket.socket | None, tls: ssl.SSLContext, *, server_side: bool,
                 target: tuple[str, int] | None = None, server_name: str | None = None) -> None:
    """Copy bytes both ways between the plain socket ``plain`` and a TLS stream until either side ends: on the
    receiver (``server_side``), ``plain`` is the accepted connection, wrapped in TLS here, and ``other`` CRIU's
    end of a socket pair; on the sender, ``plain`` is CRIU's connection and the TLS stream is opened to ``target``.
    Raises ``OSError``/``ssl.SSLError`` when the handshake fails."""
    loop = asyncio.get_running_loop()
    if server_side:
        assert other is not None
        reader = asyncio.StreamReader(limit=1 << 20)
        proto = asyncio.StreamReaderProtocol(reader)
        transport, _ = await loop.connect_accepted_socket(lambda: proto, sock=plain, ssl=tls,
                                                          ssl_handshake_timeout=30)
        secure = (reader, asyncio.StreamWriter(transport, proto, reader, loop))
        clear = await asyncio.open_connection(sock=other, limit=1 << 20)
    else:
        assert target is not None
        secure = await asyncio.wait_for(asyncio.open_connection(
            target[0], target[1], ssl=tls, server_hostname=server_name, limit=1 << 20), 30)
        clear = await asyncio.open_connection(sock=plain, limit=1 << 20)

    async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while chunk := await src.read(1 << 18):
                dst.write(chunk)
                await dst.drain()
        except (OSError, ssl.SSLError):
            pass
        finally:
            dst.close()

    await asyncio.gather(copy(secure[0], clear[1]), copy(clear[0], secure[1]))
    for _, w in (secure, clear):
        with contextlib.suppress(Exception):
            await w.wait_closed()
