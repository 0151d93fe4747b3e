"""Loop devices bound to a disk image without naming where it lives (issue 33).

The kernel shows every loop device's backing file to anyone who can read sysfs: ``/sys/block/loopN/loop/backing_file``
is the file's path as the kernel resolves it (``d_path``). A sandbox's root can take its sysfs masks away (runc makes
them inside the sandbox's own user namespace, so the kernel does not lock them), and bound with ``losetup`` every
sandbox disk on the host showed there, with the node's name and the sandbox's id
(``/var/lib/sbx/volume/nodes/<node>/sandboxes/<id>/disk.ext4``).

:func:`attach` opens the image through a detached clone of its folder (``open_tree(OPEN_TREE_CLONE)``, never attached
anywhere, so the path ends at that clone's root) and binds it with ``LOOP_CONFIGURE``: ``backing_file`` reads
``/disk.ext4``. The clone lives as long as the loop device holds the file. Everything else is as with ``losetup``:
matching a device to its file (:func:`sbx.storage.mounts.loop_devices_for`) uses the device and inode numbers, and
``losetup -j FILE`` finds it the same way; ``losetup -a`` lists it by that short name.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from pathlib import Path

from sbx.storage.errors import StorageError
from sbx.storage.idmap import _AT_FDCWD, _OPEN_TREE_CLOEXEC, _OPEN_TREE_CLONE, _syscall

# <linux/loop.h>
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_READ_ONLY = 1
LO_NAME_SIZE = 64

#: Free devices tried before giving up (another process may take the one the kernel offered first).
ATTEMPTS = 20


class _LoopInfo64(ctypes.Structure):
    """``struct loop_info64``."""

    _fields_ = [("lo_device", ctypes.c_uint64), ("lo_inode", ctypes.c_uint64), ("lo_rdevice", ctypes.c_uint64),
                ("lo_offset", ctypes.c_uint64), ("lo_sizelimit", ctypes.c_uint64), ("lo_number", ctypes.c_uint32),
                ("lo_encrypt_type", ctypes.c_uint32), ("lo_encrypt_key_size", ctypes.c_uint32),
                ("lo_flags", ctypes.c_uint32), ("lo_file_name", ctypes.c_char * LO_NAME_SIZE),
                ("lo_crypt_name", ctypes.c_char * LO_NAME_SIZE), ("lo_encrypt_key", ctypes.c_uint8 * 32),
                ("lo_init", ctypes.c_uint64 * 2)]


class _LoopConfig(ctypes.Structure):
    """``struct loop_config`` (``LOOP_CONFIGURE``, Linux 5.8)."""

    _fields_ = [("fd", ctypes.c_uint32), ("block_size", ctypes.c_uint32), ("info", _LoopInfo64),
                ("reserved", ctypes.c_uint64 * 8)]


def open_unnamed(path: str | os.PathLike[str], readonly: bool = False) -> int:
    """An fd of the file at ``path`` opened through a detached clone of its folder: the kernel names it
    ``/<file name>`` (``d_path``), never its host path. Raises ``StorageError("not_found")`` when it does not exist,
    ``StorageError("command_failed")`` when the clone is refused."""
    p = Path(path)
    try:
        tree = _syscall("open_tree", _AT_FDCWD, os.fsencode(str(p.parent)), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC)
    except OSError as e:
        code = "not_found" if e.errno == errno.ENOENT else "command_failed"
        raise StorageError(code, f"open_tree {p.parent}: {e}") from e
    try:
        return os.open(p.name, (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC, dir_fd=tree)
    except FileNotFoundError as e:
        raise StorageError("not_found", f"{p} does not exist") from e
    finally:
        os.close(tree)


def attach(path: str | os.PathLike[str], readonly: bool = False) -> str:
    """Bind a free loop device to the image at ``path`` (opened by :func:`open_unnamed`; read-only when
    ``readonly``) and return it (``/dev/loop7``). Its ``backing_file`` and ``lo_file_name`` show only the file's
    name. Raises ``StorageError``: ``not_found`` (no such file), ``command_failed`` (no free device after
    :data:`ATTEMPTS` tries, or the kernel refused)."""
    fd = open_unnamed(path, readonly)
    try:
        config = _LoopConfig(fd=fd, block_size=0)
        config.info.lo_flags = LO_FLAGS_READ_ONLY if readonly else 0
        config.info.lo_file_name = Path(path).name.encode()[:LO_NAME_SIZE - 1]
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(ATTEMPTS):
                n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
                dev = f"/dev/loop{n}"
                try:
                    lfd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
                except FileNotFoundError:  # devtmpfs makes the node a moment after the device
                    continue
                try:
                    fcntl.ioctl(lfd, LOOP_CONFIGURE, bytes(config))
                    return dev
                except OSError as e:
                    if e.errno != errno.EBUSY:  # EBUSY: someone took it between GET_FREE and here
                        raise StorageError("command_failed", f"LOOP_CONFIGURE {dev} with {path}: {e}") from e
                finally:
                    os.close(lfd)
        finally:
            os.close(ctl)
        raise StorageError("command_failed", f"no free loop device for {path} after {ATTEMPTS} tries")
    finally:
        os.close(fd)  # the loop device holds its own reference
