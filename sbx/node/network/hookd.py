"""The node's hook server: runs the work of a sandbox's OCI ``prestart`` hook inside the node process.

runc runs the prestart hook on every boot and, in the middle of CRIU's restore, on every resume with memory.
Started as its own Python process (:mod:`sbx.node.network.nethook`), the hook spent ~0.25 s importing pyroute2 before it
did ~10 ms of work, and CRIU waited for it. Now runc runs :mod:`sbx.node.network.hookclient`, a stdlib-only script,
which sends its arguments and runc's state here; a thread of this server does the same work
(:func:`sbx.node.network.nethook.apply`) with everything already imported and answers ``ok`` or the error.

The socket is ``/run/sbx/<node>/hookd/hook.sock``, mode 0600 in a root-only folder of its own; a connection whose
peer is not host root (SO_PEERCRED) is refused. Sandboxes see none of this: they have their own mount namespace
and their root is a shifted uid.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
from pathlib import Path

log = logging.getLogger("sbx.node")

MAX_REQUEST = 1 << 20


class HookServer:
    """Serve hook requests on ``path`` in daemon threads until :meth:`close`."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.bind(str(path))
        path.chmod(0o600)
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._serve, name="sbx-hookd", daemon=True)
        self._thread.start()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self.path.unlink(missing_ok=True)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), name="sbx-hook", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        from sbx.node.network.nethook import apply

        with conn:
            try:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", creds)
                if uid != 0:
                    conn.sendall(b"refused: not root\n")
                    return
                conn.settimeout(25.0)
                data = b""
                while len(data) <= MAX_REQUEST:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\n")  # NUL-separated arguments, then runc's state JSON
                args = head.decode().split("\0")
                state = json.loads(body)
                apply(args, int(state["pid"]))
                conn.sendall(b"ok\n")
            except Exception as e:  # the hook fails and runc fails the start with this message
                log.warning("sandbox hook failed: %s", e)
                try:
                    conn.sendall(f"{type(e).__name__}: {e}\n".encode())
                except OSError:
                    pass
