"""A process spawned in a sandbox on a remote node, as the caller of ``NodeAgent.spawn`` expects it: a
``subprocess.Popen`` with real pipes (``stdin``/``stdout``/``stderr``), or with ``pty_master`` the host end of a
local pseudo-terminal, relayed over the node's WebSocket ``/v1/node/spawn``.

Frames on that WebSocket:

- first, the caller sends text ``{"id", "argv", "user", "stdin", "tty", "env"}``; the node answers text
  ``{"type": "started"}`` or ``{"type": "error", "code", "message"}``;
- binary from the caller: bytes for the process's stdin (or its terminal);
- binary from the node: one channel byte (:data:`OUT_STDOUT` or :data:`OUT_STDERR`; a pty only uses stdout) then
  the bytes;
- text from the caller: ``{"type": "eof"}`` (close stdin), ``{"type": "resize", "cols", "rows"}`` (terminal
  size), ``{"type": "signal", "signal": N}``;
- text from the node, last: ``{"type": "exit", "code": N}`` (the ``returncode``; negative for a signal).

Callers use only ``poll``, ``wait``, ``kill``, ``terminate``, ``send_signal``, the three pipes and
``pty_master``; these behave as for a local process (a pipe the caller does not read fills and holds the rest).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import selectors
import signal
import struct
import subprocess
import termios
import threading
from typing import Any

OUT_STDOUT = 1
OUT_STDERR = 2
_READ_CHUNK = 65536


def _get_winsize(fd: int) -> tuple[int, int]:
    rows, cols, _, _ = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    return cols, rows


class RemoteProcess(subprocess.Popen[bytes]):
    """A process on a remote node (see the module docstring). ``ws`` is a connected
    ``websockets.sync.client.ClientConnection`` whose spawn request the node has accepted. Never built with
    ``Popen.__init__``: no local child exists (``pid`` is 0)."""

    def __init__(self, ws: Any, argv: list[str], *, stdin: bool, tty: bool):  # noqa: D107
        self._child_created = False  # Popen.__del__ looks at it
        self.args = argv
        self.pid = 0
        self.returncode: int | None = None  # type: ignore[assignment]
        self._ws = ws
        self._done = threading.Event()
        self._send_lock = threading.Lock()
        self.stdin = self.stdout = self.stderr = None
        self._sinks: dict[int, int] = {}  # channel -> local fd the node's bytes are written to
        threads = []
        if tty:
            import pty
            import tty as ttymod

            master, slave = pty.openpty()
            ttymod.setraw(slave)  # bytes pass unchanged: the sandbox's own terminal echoes and edits lines
            self.pty_master = master
            self._sinks[OUT_STDOUT] = self._sinks[OUT_STDERR] = slave
            threads.append(threading.Thread(target=self._pump_tty, args=(slave,), daemon=True))
        else:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            self.stdout = os.fdopen(out_r, "rb")
            self.stderr = os.fdopen(err_r, "rb")
            self._sinks = {OUT_STDOUT: out_w, OUT_STDERR: err_w}
            if stdin:
                in_r, in_w = os.pipe()
                self.stdin = os.fdopen(in_w, "wb")
                threads.append(threading.Thread(target=self._pump_stdin, args=(in_r,), daemon=True))
        self._tty = tty
        threads.append(threading.Thread(target=self._receive, daemon=True))
        for t in threads:
            t.start()

    # --- the Popen surface ---------------------------------------------------------------------------------------
    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._send(json.dumps({"type": "signal", "signal": int(sig)}))

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:  # no local child to reap; close the connection if it is still open
        with contextlib.suppress(Exception):
            self._ws.close()

    # --- relaying ------------------------------------------------------------------------------------------------
    def _send(self, data: bytes | str) -> bool:
        try:
            with self._send_lock:
                self._ws.send(data)
            return True
        except Exception:  # the connection is gone: the receiver ends the process
            return False

    def _receive(self) -> None:
        code = -int(signal.SIGKILL)  # the connection dropped without an exit: like a killed process
        try:
            for msg in self._ws:
                if isinstance(msg, bytes):
                    fd = self._sinks.get(msg[0]) if msg else None
                    if fd is not None:
                        with contextlib.suppress(OSError):
                            _write_all(fd, msg[1:])
                    continue
                ctl = json.loads(msg)
                if ctl.get("type") == "exit":
                    code = int(ctl["code"])
                    break
        except Exception:  # the connection broke
            pass
        finally:
            for fd in set(self._sinks.values()):
                if not self._tty:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self.returncode = code
            self._done.set()
            with contextlib.suppress(Exception):
                self._ws.close()

    def _pump_stdin(self, fd: int) -> None:
        try:
            while chunk := os.read(fd, _READ_CHUNK):
                if not self._send(chunk):
                    return
            self._send(json.dumps({"type": "eof"}))
        finally:
            os.close(fd)

    def _pump_tty(self, slave: int) -> None:
        """Bytes typed at ``pty_master`` go to the node; the caller's terminal size follows (polled every 0.25 s).
        Ends when the caller closes ``pty_master`` (EIO) or the process has exited."""
        size: tuple[int, int] | None = None
        sel = selectors.DefaultSelector()
        sel.register(slave, selectors.EVENT_READ)
        try:
            while not self._done.is_set():
                with contextlib.suppress(OSError):
                    now = _get_winsize(slave)
                    if now != size:
                        size = now
                        self._send(json.dumps({"type": "resize", "cols": now[0], "rows": now[1]}))
                if not sel.select(0.25):
                    continue
                try:
                    chunk = os.read(slave, _READ_CHUNK)
                except OSError:
                    chunk = b""
                if not chunk or not self._send(chunk):
                    self.send_signal(signal.SIGHUP)
                    return
        finally:
            sel.close()
            self._done.wait(10)
            with contextlib.suppress(OSError):
                os.close(slave)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
