"""Small helpers shared by the storage tests (named uniquely so it never clashes with other test folders)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tests.slots import slot

MiB = 1024 * 1024
HOME = Path("/var/lib/sbx-storagetest" + (f"-s{slot()}" if slot() else ""))
"""Where the storage tests make their volumes; moved per test slot (:mod:`tests.slots`) so two runs (or xdist
workers) never share one."""


def used_bytes(path: Path) -> int:
    """Bytes in use on the filesystem holding ``path`` (statfs), after flushing everything."""
    os.sync()
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def write_random(path: Path, size: int, offset: int = 0) -> None:
    """Write ``size`` random bytes at ``offset`` of ``path`` (created if missing) and fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        done = 0
        while done < size:
            n = min(MiB, size - done)
            os.pwrite(fd, os.urandom(n), offset + done)
            done += n
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def freed_after(path: Path, before: int, at_least: int, ceiling_s: float = 30.0) -> int:
    """Bytes freed on ``path``'s filesystem since ``before`` (a :func:`used_bytes` value).

    XFS finishes removing a reflinked inode in the background (deferred inode inactivation), so this polls
    until at least ``at_least`` bytes came back (or ``ceiling_s`` passed: then the caller's assertion fails),
    then reads once more after the value stays put.
    """
    import time

    end = time.monotonic() + ceiling_s
    freed = before - used_bytes(path)
    while freed < at_least and time.monotonic() < end:
        time.sleep(0.1)
        freed = before - used_bytes(path)
    while True:
        time.sleep(0.2)
        again = before - used_bytes(path)
        if again == freed or time.monotonic() >= end:
            return again
        freed = again
