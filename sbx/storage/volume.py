"""The node's data volume: an XFS filesystem with reflink, where every disk image, seal and base image lives.

The host's own ext4 has no reflink, so by default the volume is a sparse file on it
(``settings.volume_backing``, ``settings.volume_size_gib`` GiB apparent size, using only what is written)
formatted ``mkfs.xfs -m reflink=1`` and loop-mounted at ``settings.volume``. A host that already mounts a
reflink filesystem (XFS or btrfs) at ``settings.volume`` uses that as is.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sbx.config import Settings
from sbx.storage import loopdev, mounts
from sbx.storage._proc import run
from sbx.storage.errors import StorageError
from sbx.storage.locks import file_lock
from sbx.storage.reflink import supports_reflink

GiB = 1024**3


def fs_type(path: Path) -> str | None:
    """The filesystem type ``blkid`` finds in the file or device ``path`` (``"xfs"``, ``"ext4"``, ...), or
    None when it finds none."""
    proc = run(["blkid", "-p", "-o", "value", "-s", "TYPE", str(path)], ok_codes=(0, 2))
    value = proc.stdout.strip()
    return value or None


def _is_ours(settings: Settings) -> bool:
    m = mounts.mount_at(settings.volume)
    if m is None or not m.source.startswith("/dev/loop"):
        return False
    return m.source in mounts.loop_devices_for(settings.volume_backing)


def _make_dirs(settings: Settings) -> None:
    for d in (settings.images_dir, settings.volume / "nodes", settings.node_dir):
        d.mkdir(parents=True, exist_ok=True)


def _grow_backing(settings: Settings) -> bool:
    """Make the backing file at least ``volume_size_gib`` GiB (sparse); True when it grew. Never shrinks."""
    want = settings.volume_size_gib * GiB
    if settings.volume_backing.stat().st_size < want:
        os.truncate(settings.volume_backing, want)
        return True
    return False


def ensure_volume(settings: Settings) -> Path:
    """Make sure the reflink volume is mounted at ``settings.volume`` and return that path.

    Idempotent and safe to run from several processes at once (a file lock serialises them):

    - a filesystem already mounted there is used if it supports reflink (else ``StorageError("no_reflink")``);
    - otherwise ``settings.volume_backing`` is created as a sparse file of ``settings.volume_size_gib`` GiB if
      missing, formatted with ``mkfs.xfs -m reflink=1`` only if it holds no filesystem yet (an existing XFS is
      mounted again, never re-made: that is the path after a reboot), and loop-mounted through
      :func:`sbx.storage.loopdev.attach` (its ``backing_file`` in sysfs, which a sandbox's root can read once it
      takes its masks away, names ``/volume.xfs`` only; :func:`unmount_volume` detaches the device). A backing
      file smaller than the configured size is grown (sparse ``truncate`` then ``xfs_growfs``); it never shrinks.
    - the folders ``images/``, ``nodes/`` and ``nodes/<node_name>/`` are created.

    Raises ``StorageError``: ``volume_failed`` (the backing file holds another filesystem, the mount point is
    a non-empty folder, or mkfs/mount failed), ``no_reflink``.
    """
    vol = settings.volume
    with file_lock(settings.home / ".volume.lock"):
        if mounts.mount_at(vol) is not None:
            if _is_ours(settings) and _grow_backing(settings):
                for dev in mounts.loop_devices_for(settings.volume_backing):
                    run(["losetup", "-c", dev], code="volume_failed")
                run(["xfs_growfs", str(vol)], code="volume_failed")
        else:
            backing = settings.volume_backing
            backing.parent.mkdir(parents=True, exist_ok=True)
            if not backing.exists():
                fd = os.open(backing, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                os.close(fd)
            grew = _grow_backing(settings)
            kind = fs_type(backing)
            if kind is None:
                run(
                    ["mkfs.xfs", "-q", "-m", "reflink=1", "-L", "sbx-volume", str(backing)],
                    code="volume_failed",
                )
                grew = False
            elif kind != "xfs":
                raise StorageError(
                    "volume_failed", f"{backing} holds a {kind} filesystem, not XFS; refusing to overwrite it"
                )
            vol.mkdir(parents=True, exist_ok=True)
            if any(vol.iterdir()):
                raise StorageError(
                    "volume_failed",
                    f"{vol} is not mounted but not empty; refusing to mount the volume over it",
                )
            stale = mounts.loop_devices_for(backing)
            if stale:  # bound but not mounted here: reuse it (never two block devices for one XFS)
                if grew:
                    run(["losetup", "-c", stale[0]], code="volume_failed")
                run(["mount", "-t", "xfs", stale[0], str(vol)], code="volume_failed")
            else:  # bound by name only (loopdev): sysfs shows "/volume.xfs", not the host path
                dev = loopdev.attach(backing)
                try:
                    run(["mount", "-t", "xfs", dev, str(vol)], code="volume_failed")
                except BaseException:
                    run(["losetup", "-d", dev], ok_codes=(0, 1))
                    raise
            if grew:
                run(["xfs_growfs", str(vol)], code="volume_failed")
        if not supports_reflink(vol):
            raise StorageError("no_reflink", f"the filesystem mounted at {vol} does not support reflink")
        _make_dirs(settings)
    return vol


def volume_status(settings: Settings) -> dict[str, Any]:
    """What ``sbx doctor`` shows about the volume; never raises for a missing or unmounted volume.

    Shape: ``{"path": str, "backing": str, "mounted": bool, "source": str|None, "fstype": str|None,
    "reflink": bool, "size_bytes": int, "free_bytes": int, "used_bytes": int, "backing_allocated_bytes":
    int}`` (sizes from ``statvfs`` of the mounted filesystem, 0 when not mounted; ``backing_allocated_bytes``
    is what the backing file really takes on the host disk).
    """
    vol = settings.volume
    m = mounts.mount_at(vol) if vol.exists() else None
    status: dict[str, Any] = {
        "path": str(vol),
        "backing": str(settings.volume_backing),
        "mounted": m is not None,
        "source": m.source if m else None,
        "fstype": m.fstype if m else None,
        "reflink": False,
        "size_bytes": 0,
        "free_bytes": 0,
        "used_bytes": 0,
        "backing_allocated_bytes": 0,
    }
    try:
        status["backing_allocated_bytes"] = settings.volume_backing.stat().st_blocks * 512
    except OSError:
        pass
    if m is None:
        return status
    try:
        st = os.statvfs(vol)
        status["size_bytes"] = st.f_blocks * st.f_frsize
        status["free_bytes"] = st.f_bavail * st.f_frsize
        status["used_bytes"] = (st.f_blocks - st.f_bfree) * st.f_frsize
        status["reflink"] = supports_reflink(vol)
    except OSError:
        pass
    return status


def unmount_volume(settings: Settings, *, remove_backing: bool = False) -> None:
    """Unmount the volume if it is mounted, detach any loop device still bound to the backing file, and with
    ``remove_backing`` delete the backing file (every disk on it is lost). Disks on the volume must be
    unmounted first, else ``StorageError("busy")``."""
    with file_lock(settings.home / ".volume.lock"):
        if mounts.mount_at(settings.volume) is not None:
            run(["umount", str(settings.volume)], code="busy")
        for dev in mounts.loop_devices_for(settings.volume_backing):
            run(["losetup", "-d", dev], ok_codes=(0, 1))
        if remove_backing:
            settings.volume_backing.unlink(missing_ok=True)


@dataclass(frozen=True)
class FreeSpace:
    """Room left for data written to the volume: ``free_bytes`` (what an unprivileged writer may still use,
    ``statvfs`` ``f_bavail``) on ``path``, the tighter of the host filesystem that holds the volume's backing file
    and the volume itself."""

    free_bytes: int
    path: str


def free_space(settings: Settings) -> FreeSpace:
    """Where the volume runs out first. A sparse backing file grows on the host's filesystem as sandboxes write, so
    when the volume is ours (loop-mounted from ``settings.volume_backing``) both that host filesystem and the XFS
    volume count; a reflink filesystem the host mounts at ``settings.volume`` itself counts alone. An unmounted
    volume reports the host filesystem under ``settings.home`` (its nearest existing folder). Never raises."""
    candidates: list[Path] = []
    if mounts.mount_at(settings.volume) is None:
        candidates.append(settings.home)
    else:
        candidates.append(settings.volume)
        if _is_ours(settings):
            candidates.append(settings.volume_backing)
    best: FreeSpace | None = None
    for path in candidates:
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            st = os.statvfs(probe)
        except OSError:
            continue
        here = FreeSpace(st.f_bavail * st.f_frsize, str(path))
        if best is None or here.free_bytes < best.free_bytes:
            best = here
    return best or FreeSpace(0, str(settings.home))


_TRIMMED = re.compile(r"\((\d+) bytes\) trimmed")

TRIM_SLACK_BYTES = GiB
"""A threshold callers may pass to :func:`trim_volume`. Measured: a 512 MiB write right after a trim (into fresh holes
of the backing file) took 10-80% longer than one onto blocks freed but not trimmed. It is not the default: the
volume's own use counts unwritten (preallocated) extents that take nothing on the host, so the slack measure is
offset by an amount that moves with what other servers do, and an absolute threshold can miss a freed GiB."""
TRIM_ATTEMPTS = 6
TRIM_PROGRESS_BYTES = 16 * 1024 * 1024
"""How much of the backing file may hold blocks the volume no longer uses before :func:`trim_volume` gives them
back. Below it a trim is skipped: blocks freed and soon written again (memory images at every stop) then land on
space the host already gave the file, which is faster than filling fresh holes (a 512 MiB write measured 10-80%
slower right after a trim)."""


def slack_bytes(settings: Settings) -> int | None:
    """Bytes the backing file takes on the host beyond what the volume uses (``du`` of the file minus the volume's
    used blocks): what a trim would give back. None when the volume is not ours (no backing file to shrink) or not
    mounted."""
    if mounts.mount_at(settings.volume) is None or not _is_ours(settings):
        return None
    try:
        st = os.statvfs(settings.volume)
        allocated = settings.volume_backing.stat().st_blocks * 512
    except OSError:
        return None
    return allocated - (st.f_blocks - st.f_bfree) * st.f_frsize


def trim_volume(settings: Settings, min_slack: int | None = None) -> int | None:
    """Give the volume's free blocks back to the host's filesystem once they add up to ``min_slack`` bytes or more
    (:func:`slack_bytes`; None: always): ``fstrim`` makes XFS tell the loop device below it
    which blocks are free (deleted sandboxes, snapshots and memory images; holes sandbox disks punched by
    discarding), and the loop device punches those ranges out of the sparse backing file. Returns the bytes fstrim
    reports (every free range, also those given back before: a repeat costs milliseconds), or None when it did not
    run (less slack, a volume that is not a loop-mounted file of ours, not mounted). Servers on one host take
    turns (a file lock).

    The volume is not mounted with ``-o discard`` instead: XFS ignores that option on a remount, so a volume
    mounted by an older release would keep its space until every sandbox on the host stopped; a trim works on every
    volume as it is, and batches the work. Raises ``StorageError("trim_failed")``."""
    with file_lock(settings.home / ".trim.lock"):
        slack = slack_bytes(settings)
        if slack is None or (min_slack is not None and slack < min_slack):
            return None
        trimmed, before = 0, slack
        for attempt in range(TRIM_ATTEMPTS):
            if attempt:
                time.sleep(0.3)
            # XFS skips blocks whose freeing is not yet in its log on disk (busy extents; cleared a moment after
            # the log write), and frees a deleted file's blocks in the background: sync the volume (syncfs forces
            # the log), trim, and go again until a pass gives back nothing more.
            run(["sync", "-f", str(settings.volume)], code="trim_failed")
            out = run(["fstrim", "-v", str(settings.volume)], code="trim_failed").stdout
            m = _TRIMMED.search(out)
            trimmed = int(m.group(1)) if m else 0
            after = slack_bytes(settings)
            if after is None or (attempt and before - after < TRIM_PROGRESS_BYTES):
                break
            before = after
    return trimmed
