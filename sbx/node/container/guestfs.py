"""Writing files into a sandbox's root filesystem from the host without ever following its symlinks.

A sandbox's disk is loop-mounted on the host while it runs. Anything inside may be a symlink planted by the
sandbox (``/etc/hostname -> /etc/shadow``); resolved on the host, such a link would point at the host's own files.
Every path here is opened one component at a time relative to the mount's root with ``O_NOFOLLOW``, so a symlink
anywhere on the way is an error (or, for the last component of a write, is replaced by a regular file).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


class UnsafePath(Exception):
    """A path inside the sandbox crosses a symlink or leaves the root (``..``)."""


def _parts(relpath: str) -> list[str]:
    parts = [p for p in relpath.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafePath(f"'..' is not allowed in {relpath!r}")
    return parts


def _open_dir(root: Path, parts: list[str], create: bool, mode: int = 0o755) -> int:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in parts:
            try:
                nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(name, mode, dir_fd=fd)
                nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePath(f"{name!r} in the sandbox is not a plain directory") from e
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_file(root: Path, relpath: str, data: bytes, mode: int = 0o644, uid: int = 0, gid: int = 0) -> None:
    """Write ``data`` to ``root/relpath`` (parents created 0755), replacing a symlink or file there.
    Raises :class:`UnsafePath` when a parent is a symlink."""
    parts = _parts(relpath)
    dfd = _open_dir(root, parts[:-1], create=True)
    try:
        name = parts[-1]
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not (st.st_mode & 0o170000 == 0o100000):  # not a regular file: remove it
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode, dir_fd=dfd)
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)
            os.fchown(fd, uid, gid)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def ensure_path(root: Path, relpath: str, is_file: bool = False) -> None:
    """Make ``root/relpath`` exist (parents created 0755, owned by the writer): an empty 0644 file when
    ``is_file``, else a 0755 directory. Whatever is there already is left alone. Raises :class:`UnsafePath` when a
    component on the way is a symlink."""
    parts = _parts(relpath)
    if not parts:
        return
    if not is_file:
        os.close(_open_dir(root, parts, create=True))
        return
    dfd = _open_dir(root, parts[:-1], create=True)
    try:
        try:
            os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            os.close(os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd))
    finally:
        os.close(dfd)


def read_file(root: Path, relpath: str, limit: int = 1 << 20) -> bytes:
    """Read at most ``limit`` bytes of ``root/relpath``. Raises :class:`UnsafePath` on a symlink,
    ``FileNotFoundError`` when absent."""
    parts = _parts(relpath)
    dfd = _open_dir(root, parts[:-1], create=False)
    try:
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePath(f"{relpath!r} is a symlink") from e
            raise
        try:
            return os.read(fd, limit)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
