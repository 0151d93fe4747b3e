"""Idmapped mounts: a sandbox's disk shown to its container with every owner shifted into its own host range.

A sandbox's user namespace maps container uid/gid 0..65535 to host ``base``..``base+65535`` (:func:`uid_base`).
The disk is never chowned: it stays owned as in the image (root = 0), is loop-mounted plainly for the host
(``bundles/<id>/disk``), and a second, idmapped view of that mount (``bundles/<id>/rootfs``) is what runc gets as
the container's root. Through it a file owned by 0 on disk shows as ``base`` on the host and so as 0 inside, and a
file the sandbox's root creates lands on disk as 0 again (kernel docs, "Idmappings", idmapped mounts). File
capabilities and POSIX ACLs translate by themselves, and reflinked forks need no re-chown.

The mount API has no wrapper in Python or in bookworm's util-linux 2.38 (no ``mount --map-users``), so this calls
the syscalls through ctypes (man open_tree(2), mount_setattr(2), move_mount(2); x86_64 numbers 428, 442, 429):
``open_tree(OPEN_TREE_CLONE)`` detaches a copy of the plain mount, ``mount_setattr(MOUNT_ATTR_IDMAP)`` attaches the
user namespace whose map to apply, ``move_mount`` puts it in place. The user namespace comes from a short-lived
``unshare --user`` process whose ``uid_map``/``gid_map`` root writes (``0 BASE 65536``); its
``/proc/PID/ns/user`` is opened and the process ends (about 8 ms, measured).

Host root writing through the idmapped view gets EOVERFLOW (host uid 0 has no mapping in the sandbox's range):
every host-side write goes through the plain mount.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path

from sbx.storage.errors import StorageError

#: Sandbox uids/gids 0..ID_MAP_SIZE-1 are mapped.
ID_MAP_SIZE = 65536
#: The first host uid handed to sandboxes; range k starts at ``FIRST_BASE + k * ID_MAP_SIZE``. Above the ranges
#: /etc/subuid usually hands out (100000 + 65536 * users) so no login user's subordinate range overlaps.
FIRST_BASE = 1_000_000
#: Ranges stop below 2**32 - 1 (the "no uid" value).
MAX_RANGES = (2**32 - 1 - FIRST_BASE) // ID_MAP_SIZE

_SYSCALLS = {"x86_64": {"open_tree": 428, "move_mount": 429, "mount_setattr": 442},
             "aarch64": {"open_tree": 428, "move_mount": 429, "mount_setattr": 442}}
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_IDMAP = 0x100000


class _MountAttr(ctypes.Structure):
    """``struct mount_attr`` (linux/mount.h): attributes to set and clear, propagation, user namespace fd."""

    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def uid_base(k: int) -> int:
    """The first host uid of range ``k`` (0-based): ``1_000_000 + 65536 * k``. Raises ``ValueError`` when ``k``
    is negative or past :data:`MAX_RANGES`."""
    if not 0 <= k < MAX_RANGES:
        raise ValueError(f"uid range {k} out of bounds")
    return FIRST_BASE + ID_MAP_SIZE * k


def lowest_free_base(taken: Iterable[int]) -> int:
    """The lowest range base (:func:`uid_base`) not in ``taken``; bases that are not range starts (0 for the old
    identity map, say) are ignored. Raises ``StorageError("no_uid_range")`` when every range is used."""
    used = {b for b in taken if b >= FIRST_BASE and (b - FIRST_BASE) % ID_MAP_SIZE == 0}
    for k in range(MAX_RANGES):
        base = uid_base(k)
        if base not in used:
            return base
    raise StorageError("no_uid_range", "every host uid range is taken")


def _syscall(name: str, *args: object) -> int:
    nr = _SYSCALLS.get(platform.machine(), {}).get(name)
    if nr is None:
        raise StorageError("unsupported", f"{name} has no known syscall number on {platform.machine()}")
    ret = _libc.syscall(nr, *args)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return int(ret)


def userns_fd(base: int, size: int = ID_MAP_SIZE) -> int:
    """An open fd of a fresh user namespace mapping uid and gid 0..size-1 to host ``base``..``base+size-1``.

    Starts ``unshare --user`` running a shell that says when it is in the new namespace and then waits on its
    stdin; writes its ``/proc/PID/uid_map`` and ``gid_map`` (as host root, so ``setgroups`` need not be denied),
    opens ``/proc/PID/ns/user`` and lets it exit. The caller closes the fd. Raises ``StorageError("idmap_failed")``.
    """
    proc = subprocess.Popen(["unshare", "--user", "--", "/bin/sh", "-c", "echo in; read _"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != b"in":
            raise StorageError("idmap_failed", "unshare --user did not start")
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{proc.pid}/{name}", "w") as f:
                f.write(f"0 {base} {size}\n")
        return os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise StorageError("idmap_failed", f"user namespace for {base}: {e}") from e
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def idmapped_bind(source: str | os.PathLike[str], target: str | os.PathLike[str], base: int) -> None:
    """Mount a view of the mount at ``source`` at ``target`` (created when missing) in which owner ``u`` on disk
    shows as ``base + u`` (``u`` < 65536). ``base`` 0 makes a plain bind mount (the identity map of sandboxes made
    before shifted maps). Raises ``StorageError("idmap_failed")``; nothing is left mounted then."""
    Path(target).mkdir(parents=True, exist_ok=True)
    try:
        tree = _syscall("open_tree", _AT_FDCWD, os.fsencode(os.fspath(source)),
                        _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC)
    except OSError as e:
        raise StorageError("idmap_failed", f"open_tree {source}: {e}") from e
    try:
        if base:
            ns = userns_fd(base)
            try:
                attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, ns)
                _syscall("mount_setattr", tree, b"", _AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr))
            finally:
                os.close(ns)
        _syscall("move_mount", tree, b"", _AT_FDCWD, os.fsencode(os.fspath(target)), _MOVE_MOUNT_F_EMPTY_PATH)
    except OSError as e:
        raise StorageError("idmap_failed", f"idmapped mount {source} -> {target} ({base}): {e}") from e
    finally:
        os.close(tree)


def is_idmapped(mountpoint: str | os.PathLike[str]) -> bool:
    """True when the topmost mount at ``mountpoint`` carries an idmapping (``idmapped`` in its mountinfo options)."""
    real = os.path.realpath(mountpoint)
    found = False
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ")
            if len(fields) > 5 and fields[4] == real:
                found = "idmapped" in fields[5].split(",")
    return found


def unmount(target: str | os.PathLike[str]) -> None:
    """Unmount what is mounted at ``target`` (once; no-op when nothing is). Raises ``StorageError("busy")``."""
    try:
        _umount(os.fspath(target))
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOENT):
            return
        raise StorageError("busy", f"umount {target}: {e}") from e


def _umount(target: str) -> None:
    _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    if _libc.umount2(os.fsencode(target), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
