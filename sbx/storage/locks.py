"""One host-wide lock primitive for set-up steps that separate processes may run at once (two `sbx server`s,
a server and `sbx setup`): an exclusive ``flock(2)`` on a lock file, released when the block ends or the
process dies."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _open(path: Path) -> int:
    """The lock file ``path``, created (with its folder) when missing, opened for ``flock``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@contextmanager
def file_lock(path: Path, wait: bool = True, shared: bool = False) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (created, with its folder, when missing) for the ``with`` block and
    yield True; with ``shared`` a shared one (any number of shared holders, no exclusive one). With ``wait`` it
    blocks until the lock is free; without, it yields False at once when another process holds it (the block then
    runs without the lock). The kernel drops the lock if the process dies, so a
    crash never leaves it held."""
    fd = _open(path)
    try:
        try:
            mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            fcntl.flock(fd, mode if wait else mode | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def hold_shared(path: Path) -> int:
    """Take a shared ``flock`` on ``path`` (created, with its folder, when missing) and keep it: returns the open
    descriptor, whose ``os.close`` (or the process's end) releases it. Blocks while another process holds an
    exclusive one. For "in use" marks a process keeps for its whole life (:func:`sbx.node.host.image.hold_image`)."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd
