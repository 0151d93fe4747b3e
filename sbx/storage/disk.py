"""Sandbox disks: sparse ext4 image files on the reflink volume, copied copy-on-write.

A disk is a regular file holding an ext4 filesystem, with holes where nothing was written. It is made by
reflinking a base image and growing it (:func:`create_disk`), loop-mounted on the host for the sandbox
(:func:`mount`), forked by reflink under ``fsfreeze`` (:func:`clone_disk`), and checkpointed as a read-only
reflink copy in a numbered chain (:func:`sbx.storage.seals.seal`). Every copy here is a reflink, so its time does
not depend on the disk's size. Filesystem work uses e2fsprogs (``e2fsck``, ``resize2fs``, ``tune2fs``, ``dumpe2fs``).

Units: sizes given as ``*_mib`` are MiB (1 MiB = 1048576 bytes); ``*_bytes`` are bytes.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from sbx.storage import loopdev, mounts
from sbx.storage._proc import run
from sbx.storage.errors import StorageError
from sbx.storage.reflink import clone

MiB = 1024 * 1024

PathLike = str | os.PathLike[str]


# -------------------------------------------------------------------------------- filesystem


def fs_info(path: PathLike) -> dict[str, Any]:
    """The ext4 superblock facts of an image (``dumpe2fs -h``).

    Shape: ``{"uuid": str, "block_count": int, "block_size": int, "size_bytes": int (block_count*block_size),
    "features": list[str], "state": str ("clean", "not clean", ...)}``.
    Raises ``StorageError("not_found")`` or ``StorageError("bad_image")`` when there is no ext filesystem.
    """
    if not Path(path).exists():
        raise StorageError("not_found", f"{path} does not exist")
    out = run(["dumpe2fs", "-h", str(path)], code="bad_image").stdout
    fields: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    try:
        block_count = int(fields["Block count"])
        block_size = int(fields["Block size"])
        return {
            "uuid": fields["Filesystem UUID"],
            "block_count": block_count,
            "block_size": block_size,
            "size_bytes": block_count * block_size,
            "features": fields.get("Filesystem features", "").split(),
            "state": fields.get("Filesystem state", ""),
        }
    except (KeyError, ValueError) as e:
        raise StorageError("bad_image", f"{path}: unexpected dumpe2fs output ({e})") from e


def fsck(path: PathLike) -> int:
    """``e2fsck -f -y`` the unmounted image at ``path`` (replays the journal, fixes what it can) and return
    its exit status (0 clean, 1 or 2 fixed). Raises ``StorageError("bad_image")`` for 4 and above (errors
    left), ``StorageError("busy")`` when the image is mounted."""
    _refuse_mounted(path)
    return run(["e2fsck", "-f", "-y", str(path)], code="bad_image", ok_codes=(0, 1, 2)).returncode


def new_uuid(path: PathLike) -> str:
    """Give the unmounted ext4 image at ``path`` a new random filesystem UUID and return it.

    Uses ``tune2fs -U random``. With ``metadata_csum`` every checksum is seeded from the UUID, so changing it
    would rewrite (and un-share) every metadata block; turning on ``metadata_csum_seed`` first keeps the old
    seed in the superblock, so only the superblocks change (milliseconds; Linux >= 4.4 mounts such
    filesystems). If tune2fs refuses (journal needs recovery, not freshly checked) the image is fsck'd first.
    Raises ``StorageError("busy")`` when mounted, ``bad_image``.
    """
    _refuse_mounted(path)
    features = fs_info(path)["features"]
    argv = ["tune2fs"]
    if "metadata_csum" in features and "metadata_csum_seed" not in features:
        argv += ["-O", "metadata_csum_seed"]
    argv += ["-U", "random", str(path)]
    try:
        run(argv, code="bad_image")
    except StorageError:
        fsck(path)
        run(argv, code="bad_image")
    return str(fs_info(path)["uuid"])


def _refuse_mounted(path: PathLike) -> None:
    mp = mounted_at(path)
    if mp is not None:
        raise StorageError("busy", f"{path} is mounted at {mp}")


def _check_mib(size_mib: object) -> int:
    if isinstance(size_mib, bool) or not isinstance(size_mib, int) or size_mib <= 0:
        raise StorageError("invalid_resize", f"disk size must be a positive whole number of MiB, got {size_mib!r}")
    return size_mib


# -------------------------------------------------------------------------------- disks


def create_disk(base_image: PathLike, dst: PathLike, size_mib: int) -> Path:
    """Make a new sandbox disk at ``dst``: a reflink copy of the ext4 ``base_image``, grown (sparse) to
    ``size_mib`` MiB with its filesystem resized to fill it, and a fresh random filesystem UUID.

    Time does not depend on the base image's data size (reflink); e2fsck and resize2fs read metadata only.
    ``dst`` is removed again if any step fails. Returns ``dst`` as a Path.

    Raises ``StorageError``: ``invalid_resize`` (``size_mib`` not a positive int, or smaller than the base
    image), ``not_found`` (no base image), ``exists`` (``dst`` exists), ``no_reflink``, ``bad_image``.
    """
    size_mib = _check_mib(size_mib)
    base = Path(base_image)
    if not base.exists():
        raise StorageError("not_found", f"base image {base} does not exist")
    if base.stat().st_size > size_mib * MiB:
        raise StorageError(
            "invalid_resize",
            f"base image {base} is {base.stat().st_size // MiB} MiB, more than the {size_mib} MiB asked for",
        )
    out = clone(base, dst)
    try:
        _grow_file_and_fs(out, size_mib)
        new_uuid(out)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


def _grow_file_and_fs(path: Path, size_mib: int) -> None:
    want = size_mib * MiB
    if path.stat().st_size < want:
        os.truncate(path, want)
    if fs_info(path)["size_bytes"] < want:
        fsck(path)
        run(["resize2fs", str(path), f"{size_mib}M"], code="bad_image")


def grow(path: PathLike, size_mib: int) -> None:
    """Grow the unmounted disk at ``path`` to ``size_mib`` MiB: extend the file (sparse), ``e2fsck -f -y``, then
    ``resize2fs`` so the ext4 fills it. The same size again is a no-op that also finishes a grow interrupted
    after the file was extended.

    Growing a mounted disk is refused: online ext4 resize needs ``CAP_SYS_RESOURCE``, which hosts running sbx
    may lack (resize2fs fails with "Permission denied"), so a resize stops the sandbox first.

    Raises ``StorageError``: ``invalid_resize`` (smaller than now: disks never shrink; or not a positive int),
    ``busy`` (mounted), ``not_found``, ``bad_image``.
    """
    size_mib = _check_mib(size_mib)
    p = Path(path)
    if not p.exists():
        raise StorageError("not_found", f"{p} does not exist")
    cur = p.stat().st_size
    if size_mib * MiB < cur:
        raise StorageError(
            "invalid_resize",
            f"{p} is {cur / MiB:g} MiB; refusing to shrink it to {size_mib} MiB (disks only grow)",
        )
    mp = mounted_at(p)
    if mp is not None:
        raise StorageError("busy", f"{p} is mounted at {mp}; unmount it (stop the sandbox) to grow it")
    _grow_file_and_fs(p, size_mib)


def remove_disk(path: PathLike) -> None:
    """Delete the disk (or seal) image at ``path``; blocks shared with other files stay. Missing is fine.
    Raises ``StorageError("busy")`` when it is mounted."""
    _refuse_mounted(path)
    Path(path).unlink(missing_ok=True)


# -------------------------------------------------------------------------------- mounts


def mounted_at(path: PathLike) -> Path | None:
    """Where the image file at ``path`` is loop-mounted in this mount namespace, or None."""
    for dev in mounts.loop_devices_for(path):
        mps = mounts.mountpoints_of(dev)
        if mps:
            return mps[0]
    return None


def mount(path: PathLike, mountpoint: PathLike, *, readonly: bool = False) -> str:
    """Loop-mount the ext4 image ``path`` at ``mountpoint`` (created if missing) and return the loop device.

    Binds a free loop device (:func:`sbx.storage.loopdev.attach`: its ``backing_file`` names only the file, never
    the host path holding the sandbox's id), then mounts it; the device is detached again if the mount fails.
    Mounting an image again at the same place is a no-op. A read-write mount uses ``-o discard``: blocks a sandbox
    frees are discarded as its journal commits, and the loop device turns each discard into a hole punched in the
    image file, so deleted data stops taking room on the volume (issue 17; the volume's own
    free blocks go back to the host with :func:`sbx.storage.volume.trim_volume`).

    Raises ``StorageError``: ``not_found``, ``busy`` (the image is mounted elsewhere — two mounts of one ext4
    would corrupt it — or something else is mounted at ``mountpoint``), ``command_failed``.
    """
    p, mp = Path(path), Path(mountpoint)
    if not p.exists():
        raise StorageError("not_found", f"{p} does not exist")
    mp.mkdir(parents=True, exist_ok=True)
    here = Path(os.path.realpath(mp))
    cur = mounted_at(p)
    if cur is not None:
        if cur == here:
            m = mounts.mount_at(here)
            assert m is not None
            return m.source
        raise StorageError("busy", f"{p} is already mounted at {cur}")
    if mounts.mount_at(here) is not None:
        raise StorageError("busy", f"something else is mounted at {here}")
    existing = mounts.loop_devices_for(p)
    if existing:
        # Bound already (a crash between losetup and mount, or mounted only in another mount namespace): reuse
        # that device; a second loop device would give the kernel two ext4 superblocks for one file.
        dev, made = existing[0], False
    else:
        dev, made = loopdev.attach(p, readonly), True
    try:
        run(["mount", "-t", "ext4", "-o", "ro" if readonly else "rw,discard", dev, str(here)])
    except BaseException:
        if made:
            run(["losetup", "-d", dev], ok_codes=(0, 1))
        raise
    return dev


def umount(mountpoint: PathLike) -> None:
    """Unmount ``mountpoint`` and detach its loop device when nothing else mounts it. Nothing mounted there
    is fine (no-op). Raises ``StorageError("busy")`` when the filesystem is in use."""
    m = mounts.mount_at(mountpoint)
    if m is None:
        return
    run(["umount", str(m.mountpoint)], code="busy")
    if m.source.startswith("/dev/loop") and not mounts.mountpoints_of(m.source):
        run(["losetup", "-d", m.source], ok_codes=(0, 1))


def detach(path: PathLike) -> None:
    """Unmount the image at ``path`` wherever it is mounted in this mount namespace and detach every loop device
    bound to it (for deleting a disk, or cleaning up orphans after a crash). A device still in use in another
    mount namespace is detached by the kernel when its last user goes. Raises ``StorageError("busy")``."""
    for dev in mounts.loop_devices_for(path):
        for mp in sorted(mounts.mountpoints_of(dev), key=lambda m: len(str(m)), reverse=True):
            run(["umount", str(mp)], code="busy")
        run(["losetup", "-d", dev], ok_codes=(0, 1))


def syncfs(mountpoint: PathLike) -> None:
    """syncfs(2) the filesystem mounted at ``mountpoint``: its dirty data and metadata reach its device (a loop
    device writes them into its image file, which a reflink or a ``FIEMAP_FLAG_SYNC`` map then sees), whether or
    not an unmount then shuts the filesystem down. Raises ``StorageError("command_failed")``."""
    fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc().syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise StorageError("command_failed", f"syncfs {mountpoint}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def freeze(mountpoint: PathLike) -> None:
    """``fsfreeze -f``: flush the filesystem mounted at ``mountpoint`` and block new writes until
    :func:`thaw`.
    Raises ``StorageError("not_mounted")`` or ``command_failed`` (for example, already frozen)."""
    if mounts.mount_at(mountpoint) is None:
        raise StorageError("not_mounted", f"nothing is mounted at {mountpoint}")
    run(["fsfreeze", "-f", str(mountpoint)])


def thaw(mountpoint: PathLike) -> None:
    """``fsfreeze -u``: let writes to ``mountpoint`` go on. Raises ``StorageError("command_failed")`` when it
    is not frozen."""
    run(["fsfreeze", "-u", str(mountpoint)])


@contextmanager
def frozen(mountpoint: PathLike) -> Iterator[None]:
    """Freeze ``mountpoint`` for the ``with`` block and always thaw it afterwards, even on error."""
    freeze(mountpoint)
    try:
        test_hold(TEST_HOLD_ENV, Path(f"{mountpoint}.frozen-hold"))
        yield
    finally:
        thaw(mountpoint)


TEST_HOLD_ENV = "SBX_TEST_HOLD_FROZEN"
"""Test-only: seconds :func:`frozen` keeps a filesystem frozen before its body runs, with a marker file
``<mountpoint>.frozen-hold`` present meanwhile, so fault tests can kill the server in that window every time.
Unset (the default) in production."""


def test_hold(env: str, marker: Path) -> None:
    """Test-only pause: when the environment variable ``env`` holds a positive number of seconds, create the file
    ``marker``, sleep that long, then remove it (fault tests kill the server once the marker exists). Does nothing
    when ``env`` is unset, empty or not a number (production)."""
    try:
        hold = float(os.environ.get(env) or 0)
    except ValueError:
        hold = 0.0
    if hold <= 0:
        return
    marker.write_text(f"{os.getpid()}\n")
    time.sleep(hold)
    marker.unlink(missing_ok=True)


def consistent_clone(src: Path, dst: PathLike, mountpoint: PathLike | None, mode: int) -> Path:
    """Reflink ``src`` to ``dst`` (file mode ``mode``), under ``fsfreeze`` of its filesystem when it is mounted (at
    ``mountpoint``, or wherever :func:`mounted_at` finds it), so the copy holds every acknowledged write. Raises
    ``StorageError``: ``not_mounted`` (``mountpoint`` given but nothing mounted there), what :func:`clone` raises."""
    if mountpoint is not None and mounts.mount_at(mountpoint) is None:
        raise StorageError("not_mounted", f"nothing is mounted at {mountpoint}")
    mp = mountpoint if mountpoint is not None else mounted_at(src)
    with frozen(mp) if mp is not None else nullcontext():
        return clone(src, dst, mode=mode)


def clone_synced(src: PathLike, dst: PathLike, mode: int = 0o644) -> Path:
    """Reflink the mounted disk ``src`` of a sandbox whose every task is frozen (cgroup freezer: each write they
    made has returned) to ``dst``: a syncfs(2) of its filesystem puts all of it in the image file, and the reflink
    (XFS writes the file's dirty pages back first) is the disk of this instant. No ``fsfreeze``: beside a CRIU
    dump it made every dump fail on the frozen filesystem's inotify watches ("error parsing [inotify wd:1 ...]"),
    and before the dump it cost 40-70 ms of the pause. The copy's journal may need recovery: a mount or
    ``tune2fs`` (:func:`new_uuid`) replays it. Raises ``StorageError``: ``not_mounted``, what :func:`clone`
    raises."""
    mp = mounted_at(src)
    if mp is None:
        raise StorageError("not_mounted", f"{src} is not mounted")
    syncfs(mp)
    return clone(src, dst, mode=mode)


def clone_disk(src: PathLike, dst: PathLike, mountpoint: PathLike | None = None, fresh_uuid: bool = True,
               mode: int = 0o644) -> Path:
    """Fork the disk ``src`` to ``dst`` (reflink; constant time; file mode ``mode``) and give the copy a new
    filesystem UUID (unless ``fresh_uuid`` is false: the caller then runs :func:`new_uuid` on it later, ~10-20 ms
    of tune2fs; a migration keeps it: the disk moves).

    When ``src`` is mounted (a running sandbox) — at ``mountpoint``, or wherever :func:`mounted_at` finds it —
    its filesystem is frozen for the copy, so every write acknowledged before the call is in ``dst`` and the
    copy's filesystem is clean. Only ``dst`` gets the new UUID. ``dst`` is removed again on failure.

    Raises ``StorageError``: ``not_found``, ``exists``, ``no_reflink``, ``not_mounted`` (``mountpoint`` given
    but nothing mounted there), ``bad_image``.
    """
    s = Path(src)
    if not s.exists():
        raise StorageError("not_found", f"{s} does not exist")
    out = consistent_clone(s, dst, mountpoint, mode)
    if not fresh_uuid:
        return out
    try:
        new_uuid(out)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out
