"""A sandbox's root filesystem on the host under a shifted uid map (issue 17): its uid range, the disk's two mounts
and the folders only it and host root may enter.

- uid range: each sandbox maps its uids/gids 0..65535 to a host range of its own starting at ``uidBase`` (stored in
  its ``node.json``; :func:`sbx.storage.idmap.uid_base`): the lowest range no sandbox of any node on the host holds,
  picked by :func:`uid_range` under a host-wide lock.
- mounts: the disk is loop-mounted plainly at ``bundles/<id>/disk`` (the host's unshifted view, where every host-side
  write goes) and an idmapped view of that mount at ``bundles/<id>/rootfs`` is the container's root
  (:mod:`sbx.storage.idmap`; the disk is never chowned).
- folders: a sandbox's folder (disk, seals, memory image) and its bundle are ``0710`` root:``uidBase``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sbx.node.container import guestfs
from sbx.runtime.oci import mount_targets
from sbx.storage import disk as disks
from sbx.storage import idmap, mounts
from sbx.storage.errors import StorageError
from sbx.storage.locks import file_lock

log = logging.getLogger("sbx.node")


def taken_uid_bases(volume: Path) -> set[int]:
    """``uidBase`` of every sandbox record of every node on this host (``<volume>/nodes/*/sandboxes/*/node.json``)
    and of every image build's claim (``<volume>/nodes/*/builds/*.json``, :mod:`sbx.node.images.reserve`); a record
    without one (identity map) counts as 0, unreadable records are skipped."""
    taken = set()
    nodes = volume / "nodes"
    for p in [*nodes.glob("*/sandboxes/*/node.json"), *nodes.glob("*/builds/*.json")]:
        try:
            taken.add(int(json.loads(p.read_text()).get("uidBase", 0)))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return taken


@contextmanager
def uid_range(home: Path, volume: Path) -> Iterator[int]:
    """Hold the host-wide uid-range lock (``<home>/.uidmap.lock``: every node on the host draws from one pool) and
    yield the lowest free range base; save the record that claims it inside the ``with`` block. Raises
    ``StorageError("no_uid_range")`` when every range is taken."""
    with file_lock(home / ".uidmap.lock"):
        yield idmap.lowest_free_base(taken_uid_bases(volume))


def make_private(folder: Path, gid: int) -> None:
    """Make a sandbox's folder (its disk, seals and memory image; or its bundle with the disk's mounts) reachable
    only by host root and the sandbox's own shifted group ``gid`` (``0710``; ``0700`` for the identity map):
    restored tasks run as that gid and CRIU opens the memory image through it, while another sandbox's host uid,
    were it ever to reach the host's filesystem, finds every other sandbox's disk closed."""
    os.chown(folder, 0, gid)
    folder.chmod(0o710 if gid else 0o700)


def mount_root(image: Path, host: Path, rootfs: Path, base: int) -> None:
    """Mount the disk ``image`` plainly at ``host`` and its view shifted by ``base`` (0: a plain bind) at
    ``rootfs``; nothing to do when both are there. After a host reboot or a crash between the two mounts, whatever
    is left is unmounted and both are made again. Raises ``StorageError`` (nothing is left mounted then)."""
    devs = mounts.loop_devices_for(image)
    plain, view = mounts.mount_at(host), mounts.mount_at(rootfs)
    if (plain is not None and view is not None and plain.source in devs and view.source in devs
            and (base == 0 or idmap.is_idmapped(rootfs))):
        return
    umount_root(image, rootfs)
    try:
        disks.mount(image, host)
        idmap.idmapped_bind(host, rootfs, base)
    except Exception:
        umount_root(image, rootfs)
        raise


BUSY_WAIT = 5.0
"""Seconds an unmount that finds its mount in use tries again (every 0.1 s) before it gives up: the processes of a
container just killed may still be letting go of their files (seen once after a delete right behind an exec)."""


def _umount_patiently(mountpoint: Path, busy_wait: float) -> None:
    """:func:`sbx.storage.disk.umount`, tried again while it is ``busy`` for up to ``busy_wait`` seconds; a wait
    is logged with who held the mount (:func:`holders_of`). Raises ``StorageError("busy")`` after that."""
    deadline = time.monotonic() + busy_wait
    first: float | None = None
    while True:
        try:
            disks.umount(mountpoint)
        except StorageError as e:
            if e.code != "busy" or time.monotonic() >= deadline:
                if e.code == "busy":
                    log.warning("%s stayed busy for %.1f s; held by: %s", mountpoint, busy_wait,
                                ", ".join(holders_of(mountpoint)) or "no process found")
                raise
            if first is None:
                first = time.monotonic()
                log.info("%s is busy (held by: %s); trying again", mountpoint,
                         ", ".join(holders_of(mountpoint)) or "no process found")
            time.sleep(0.1)
            continue
        if first is not None:
            log.info("%s let go after %.2f s", mountpoint, time.monotonic() - first)
        return


def holders_of(mountpoint: Path) -> list[str]:
    """``"PID (COMM): what"`` of each process whose cwd, root, open file or mapped file is under ``mountpoint``
    (a look through /proc, for the log of a busy unmount)."""
    prefix = str(mountpoint).rstrip("/") + "/"
    found: list[str] = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            links = [pid_dir / "cwd", pid_dir / "root", *(pid_dir / "fd").iterdir()]
            hits = []
            for link in links:
                try:
                    target = os.readlink(link)
                except OSError:
                    continue
                if target == prefix[:-1] or target.startswith(prefix):
                    hits.append(f"{link.name}={target}")
            maps = (pid_dir / "maps").read_text(errors="replace")
            if prefix in maps:
                hits.append("maps")
            if hits:
                comm = (pid_dir / "comm").read_text().strip()
                found.append(f"{pid_dir.name} ({comm}): {' '.join(hits[:3])}")
        except OSError:
            continue
    return found


def umount_root(image: Path, rootfs: Path, busy_wait: float = BUSY_WAIT) -> None:
    """Unmount every mount of the disk ``image``, after a syncfs(2) of it: the view at ``rootfs`` first, then the
    plain mount (which detaches the loop device); a mount in use is tried again for ``busy_wait`` seconds
    (:data:`BUSY_WAIT`). Raises ``StorageError("busy")`` when one is still in use then."""
    first = os.path.realpath(rootfs)
    mps = _mounts_of(image)
    if mps:  # everything written reaches the image now, even if another namespace keeps the filesystem alive
        try:
            disks.syncfs(mps[0])
        except (OSError, StorageError) as e:
            log.warning("syncfs of %s failed before its unmount: %s", mps[0], e)
    for _ in range(8):
        if not mps:
            return
        mps.sort(key=lambda mp: str(mp) != first)
        _umount_patiently(mps[0], busy_wait)
        mps = _mounts_of(image)


def unmount_disk(image: Path, rootfs: Path, name: str, wait: float = 15.0) -> None:
    """Unmount the sandbox ``name``'s disk ``image`` (:func:`umount_root`: the idmapped view at ``rootfs`` first,
    then the plain mount, then any other mount of it) and wait until no loop device holds the image any more, so
    the next e2fsck/resize2fs/reflink sees a quiet file (a dying container's mount namespace can keep the filesystem
    alive for a moment after the host's unmount, and the loop device then detaches lazily). Copies of the mount that
    other mount namespaces still hold after 0.5 s (at once with ``wait`` 0, a delete's: it doesn't wait for the loop
    device) are unmounted there (:func:`release_holders`). Raises what :func:`umount_root` raises."""
    umount_root(image, rootfs)
    start = time.monotonic()
    released = False
    while mounts.loop_devices_for(image):
        waited = time.monotonic() - start
        if not released and (waited > 0.5 or waited >= wait):  # another mount namespace holds a copy
            released = True
            for held in release_holders(image):
                log.warning("%s: unmounted the copy of its disk that process %s held", name, held)
            continue
        if waited >= wait:
            if wait:
                log.warning("%s: a loop device still holds its disk %.0f s after the unmount", name, wait)
            break
        time.sleep(0.05)


def _mounts_of(image: Path) -> list[Path]:
    return [mp for dev in mounts.loop_devices_for(image) for mp in mounts.mountpoints_of(dev)]


def release_holders(image: Path) -> list[str]:
    """Lazily unmount (``umount -l`` run in each one, through ``nsenter``) the copies of the disk ``image``'s
    mounts that other mount namespaces on the host still hold (:func:`sbx.storage.mounts.holders`: made by a
    process that unshared its mount namespace while the sandbox ran), so the filesystem shuts down and its loop
    device goes instead of outliving the sandbox's stop, where the next mount of the image would make a second
    live filesystem on it. Returns ``"PID MOUNTPOINT"`` of each one unmounted; one that fails is logged."""
    done: list[str] = []
    for dev in mounts.loop_devices_for(image):
        for pid, points in mounts.holders(dev).items():
            for mp in sorted(points, key=lambda p: len(str(p)), reverse=True):
                r = subprocess.run(["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", "umount", "-l", str(mp)],
                                   capture_output=True, text=True, timeout=10)
                if r.returncode == 0:
                    done.append(f"{pid} {mp}")
                else:
                    log.warning("could not unmount the copy of %s at %s in process %d's mount namespace: %s",
                                image, mp, pid, r.stderr.strip())
    return done


def precreate_mount_targets(host: Path, config: dict[str, Any]) -> None:
    """Make the mount targets of the OCI ``config`` on the plain mount ``host``: runc's restore creates missing ones
    as host root through the root path, which the idmapped view refuses (EOVERFLOW, measured for the LXCFS files
    over ``/proc/*``). Raises :class:`sbx.node.container.guestfs.UnsafePath` or ``OSError``."""
    for dest, is_file in mount_targets(config):
        guestfs.ensure_path(host, dest, is_file=is_file)
