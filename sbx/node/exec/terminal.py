"""Pseudo-terminal sizes, shared by the node's ``spawn`` (:mod:`sbx.node.exec.jobs`), its WebSocket relay
(:mod:`sbx.node.remote.spawned`) and the API's terminal sessions (:mod:`sbx.api.sandbox_io`)."""

from __future__ import annotations

import fcntl
import struct
import termios


def set_winsize(fd: int, cols: int, rows: int) -> None:
    """Set the size of the pseudo-terminal behind ``fd`` (either end) to ``cols`` x ``rows`` characters, each
    clamped to 1..1000. The foreground process group of the terminal, when there is one, gets ``SIGWINCH``.
    Raises ``OSError`` when ``fd`` is not a terminal."""
    cols = max(1, min(cols, 1000))
    rows = max(1, min(rows, 1000))
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
