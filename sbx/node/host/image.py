"""The default sandbox base image: build it once per recipe, cache it on the data volume.

:func:`ensure_image` returns ``settings.images_dir / "<recipe hash>.ext4"``, a sparse ext4 filesystem image
holding a Debian root filesystem made from :mod:`sbx.guest.recipe`. The disk layer copies (reflinks) it per
sandbox and grows it to the sandbox's disk size.

The build: ``mmdebstrap`` (root mode, directory output) from the Debian mirror the host's own apt sources use
(read at run time by :mod:`sbx.node.host.aptsources`), the
recipe's customisation applied in the rootfs (files copied, commands run with ``chroot``), then
``mkfs.ext4 -d`` into a sparse file about 1.5 times the content, built under a temporary name and renamed into
place. A lock file (``flock``) next to the image keeps two builds of the same recipe from racing.

Importing this module has no side effects.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from sbx.config import Settings
from sbx.guest import recipe
from sbx.node.host.aptsources import NoMirror, mirror_lines
from sbx.node.host.tools import run_checked
from sbx.node.types import NodeError
from sbx.storage import mounts
from sbx.storage.locks import file_lock, hold_shared

Progress = Callable[[str], None]

#: Image size = content bytes * this factor, rounded up to :data:`SIZE_ROUND` (the disk layer grows it later).
SIZE_FACTOR = 1.5
SIZE_ROUND = 64 * 1024 * 1024
#: Floor for the image size in bytes, so a tiny rootfs still gets room for ext4's own metadata.
MIN_SIZE = 256 * 1024 * 1024
#: Suffix of the file a running node holds a shared lock on while it uses an image (:func:`hold_image`).
IN_USE_SUFFIX = ".inuse"
#: Filesystem label of every base image.
FS_LABEL = str(recipe.FILESYSTEM["label"])


class ImageError(NodeError):
    """Building the base image failed (code ``image_build_failed``) or no Debian mirror could be found in the
    host's apt sources (code ``no_debian_mirror``, from :class:`sbx.node.host.aptsources.NoMirror`)."""

    def __init__(self, message: str, code: str = "image_build_failed"):
        super().__init__(code, message)


# --------------------------------------------------------------------------------------------------------
# Building


def image_path(settings: Settings) -> Path:
    """Where the image for the current recipe lives: ``settings.images_dir / "<recipe hash>.ext4"``."""
    return settings.images_dir / f"{recipe.recipe_hash()}.ext4"


def ensure_image(settings: Settings, progress: Progress | None = None) -> Path:
    """Return the path of the base image for the current recipe, building it first if it is missing.

    The image is ``settings.images_dir / "<recipe_hash>.ext4"`` (a sparse ext4 file, label ``sbx-root``,
    about 1.5x its content) with ``<recipe_hash>.json`` next to it (build facts). ``progress`` gets one-line
    status messages. Concurrent callers wait on a lock file and share one build. A build takes about a
    minute and needs network access to the host's Debian mirror. After a build, images of older recipes are
    deleted (:func:`prune_images`).

    Raises :class:`ImageError` when the mirror is unknown or a build step fails.
    """
    say = progress or (lambda _msg: None)
    target = image_path(settings)
    if target.is_file():
        return target
    digest = target.stem
    with file_lock(target.parent / f"{digest}.lock"):
        if target.is_file():
            return target
        build_image(target, say)
    prune_images(settings, keep=target)
    return target


def prune_images(settings: Settings, keep: Path) -> list[Path]:
    """Delete the cached images of other recipes than ``keep`` (with their ``.json``); returns what was deleted.
    Images made from a Dockerfile or an OCI image (:mod:`sbx.node.images`) are never pruned here.

    Safe for sandboxes made from them: a sandbox disk or snapshot is a reflink copy, whose blocks stay allocated
    while any copy uses them. An image whose lock another process holds (a build in progress) is left alone, and
    so is one a running node holds (:func:`hold_image`: another sbx version on this host, whose next cold boot or
    template would otherwise build its image again and prune this one in turn)."""
    deleted: list[Path] = []
    for old in sorted(settings.images_dir.glob("*.ext4")):
        if old == keep or not _is_default_image(old):
            continue
        lock, in_use = old.with_suffix(".lock"), old.with_suffix(IN_USE_SUFFIX)
        # no mark: no node has used it since it was made (a holder creates the file)
        held = file_lock(in_use, wait=False) if in_use.exists() else nullcontext(True)
        with file_lock(lock, wait=False) as taken, held as unused:
            if not (taken and unused):
                continue
            old.unlink(missing_ok=True)
            old.with_suffix(".json").unlink(missing_ok=True)
            old.with_suffix(".base.oci.tar").unlink(missing_ok=True)  # its FROM sbx-debian archive, if made
            lock.unlink(missing_ok=True)
            in_use.unlink(missing_ok=True)
            deleted.append(old)
    return deleted


def _is_default_image(path: Path) -> bool:
    """False for an image made from a Dockerfile or an OCI image (:mod:`sbx.node.images`: its ``.json`` holds an
    ``init``, its source sits beside it as ``.oci.tar``), which only its own deletion removes; True otherwise."""
    if path.with_suffix(".oci.tar").exists():
        return False
    try:
        return "init" not in json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError, TypeError):
        return True


def hold_image(image: Path) -> int:
    """Mark the image ``image`` in use by this process for as long as it runs: a shared ``flock`` on
    ``<image>.inuse`` (any number of nodes may hold one), which :func:`prune_images` will not delete. Returns the
    descriptor; ``os.close`` releases the hold (the process's end does too)."""
    return hold_shared(image.with_suffix(IN_USE_SUFFIX))


def build_image(target: Path, progress: Progress | None = None) -> None:
    """Build the image for the current recipe at ``target`` (overwritten atomically: a temporary file in the
    same folder is renamed over it). The caller holds the lock. Raises :class:`ImageError`."""
    say = progress or (lambda _msg: None)
    start = time.monotonic()
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f".build-{target.stem}-*"):
        _detach_mounts(stale)  # a build killed before its mounts were private may have left some: never rmtree them
        shutil.rmtree(stale, ignore_errors=True)
    work = folder / f".build-{target.stem}-{os.getpid()}"
    work.mkdir(mode=0o700)
    rootfs = work / "rootfs"
    try:
        try:
            lines = mirror_lines()
        except NoMirror as e:
            raise ImageError(e.message, code=e.code) from e
        say(f"Debian mirror: {lines[0].split()[1]}")
        _bootstrap(rootfs, lines, say)
        say("Customising the root filesystem")
        customise_rootfs(rootfs)
        content = _content_bytes(rootfs)
        size = max(MIN_SIZE, -(-int(content * SIZE_FACTOR) // SIZE_ROUND) * SIZE_ROUND)
        tmp = work / "image.ext4"
        say(f"Writing ext4 image ({content // 2**20} MiB of files in a {size // 2**20} MiB filesystem)")
        _mkfs(rootfs, tmp, size)
        meta = {
            "recipe_hash": target.stem,
            "suite": recipe.SUITE,
            "packages": list(recipe.PACKAGES),
            "mirror": lines,
            "content_bytes": content,
            "size_bytes": size,
            "build_seconds": round(time.monotonic() - start, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        meta_tmp = work / "image.json"
        meta_tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(meta_tmp, target.with_suffix(".json"))
        os.replace(tmp, target)
        fsync_dir(folder)
        say(f"Image ready: {target} ({time.monotonic() - start:.0f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_ext4(rootfs: Path, out: Path) -> tuple[int, int]:
    """Write the root filesystem at ``rootfs`` into a new sparse ext4 image ``out`` as the base image is written
    (:data:`sbx.guest.recipe.FILESYSTEM`, about :data:`SIZE_FACTOR` times the content, at least :data:`MIN_SIZE`,
    checked with ``e2fsck -n`` and fsynced). Returns ``(content bytes, image size in bytes)``. Raises
    :class:`ImageError`. Used for images made from a Dockerfile or an OCI image (:mod:`sbx.node.images`)."""
    content = _content_bytes(rootfs)
    size = max(MIN_SIZE, -(-int(content * SIZE_FACTOR) // SIZE_ROUND) * SIZE_ROUND)
    _mkfs(rootfs, out, size)
    return content, size


def detach_mounts(under: Path) -> None:
    """Lazily unmount every mount at or below ``under`` (deepest first), so removing the folder never reaches into
    a mounted filesystem (a build killed before its mounts went)."""
    _detach_mounts(under)


def _detach_mounts(under: Path) -> None:
    """Lazily unmount every mount at or below ``under`` (deepest first), so removing the folder never reaches into
    a mounted filesystem."""
    prefix = str(under).rstrip("/") + "/"
    points = [m.mountpoint for m in mounts.mounts() if str(m.mountpoint).startswith(prefix)]
    for point in sorted(points, key=lambda p: len(str(p)), reverse=True):
        subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)


def _run(argv: list[str], what: str) -> subprocess.CompletedProcess[str]:
    return run_checked(argv, what, ImageError)


def _bootstrap(rootfs: Path, lines: list[str], say: Progress) -> None:
    # In a mount namespace of its own: mmdebstrap's root mode mounts proc, sys, dev and a tmpfs for /dev/shm,
    # and on this host one of those landed on the host's own /dev/shm (a killed build left it there, hiding the
    # shared memory of every process that had it open, e.g. PostgreSQL's). Its mounts now end with the build.
    argv = [
        "unshare", "--mount", "--propagation", "private", "--",
        "mmdebstrap",
        "--mode=root",
        "--format=directory",
        f"--variant={recipe.VARIANT}",
        f"--components={','.join(recipe.COMPONENTS)}",
        f"--include={','.join(recipe.PACKAGES)}",
        *[f"--dpkgopt={opt}" for opt in recipe.DPKG_OPTIONS],
        recipe.SUITE,
        str(rootfs),
        *lines,
    ]
    count = len(recipe.PACKAGES)
    say(f"Bootstrapping Debian {recipe.SUITE} ({recipe.VARIANT} + {count} packages) with mmdebstrap")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", LC_ALL="C.UTF-8")
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, errors="replace"
        )
    except FileNotFoundError as e:
        raise ImageError("mmdebstrap is not installed (run `sbx setup`)") from e
    tail: deque[str] = deque(maxlen=40)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail.append(line)
        if line.startswith("I: "):
            say("mmdebstrap: " + line[3:])
    if proc.wait() != 0:
        raise ImageError(f"mmdebstrap failed (exit {proc.returncode}):\n" + "\n".join(tail))


def _inside(rootfs: Path, path: str) -> Path:
    return rootfs / path.lstrip("/")


def customise_rootfs(rootfs: Path) -> None:
    """Apply the recipe's customisation to the unpacked rootfs at ``rootfs`` (guest files, user, masked and
    enabled units, default target, removals, empty and plain files). Commands run with ``chroot``.
    Raises :class:`ImageError`."""
    src_root = recipe.files_dir()
    for f in recipe.GUEST_FILES:
        dest = _inside(rootfs, f.dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink():
            dest.unlink()
        shutil.copyfile(src_root / f.src, dest)
        os.chown(dest, 0, 0)
        os.chmod(dest, f.mode)

    user = recipe.USER
    chroot = ["chroot", str(rootfs)]
    _run([*chroot, "groupadd", "--gid", str(user.gid), user.name], "groupadd")
    _run(
        [
            *chroot, "useradd",
            "--uid", str(user.uid), "--gid", str(user.gid),
            "--groups", ",".join(user.groups),
            "--home-dir", user.home, "--create-home",
            "--shell", user.shell,
            user.name,
        ],
        "useradd",
    )  # fmt: skip
    # "*": no password login, but not "locked" either (sshd refuses key logins to locked accounts).
    _run([*chroot, "usermod", "--password", "*", user.name], "usermod")

    _run([*chroot, "systemctl", "mask", *recipe.MASKED_UNITS], "systemctl mask")
    _run([*chroot, "systemctl", "enable", *recipe.ENABLED_UNITS], "systemctl enable")
    _run([*chroot, "systemctl", "set-default", recipe.DEFAULT_TARGET], "systemctl set-default")

    for pattern in recipe.REMOVE_GLOBS:
        for hit in glob.glob(str(_inside(rootfs, pattern))):
            os.unlink(hit)
    for path in recipe.EMPTY_FILES:
        p = _inside(rootfs, path)
        if p.is_symlink():
            p.unlink()
        p.write_bytes(b"")
        os.chmod(p, 0o444 if path == "/etc/machine-id" else 0o644)
    for path, content in recipe.PLAIN_FILES.items():
        p = _inside(rootfs, path)
        if p.is_symlink() or p.exists():
            p.unlink()
        p.write_text(content)
        os.chmod(p, 0o644)
    for path, old, new in recipe.TEXT_EDITS:
        p = _inside(rootfs, path)
        text = p.read_text()
        if old not in text:
            raise ImageError(f"image recipe: {path} no longer contains {old!r}; update recipe.TEXT_EDITS")
        p.write_text(text.replace(old, new))
    # mmdebstrap already empties /tmp, /run and the apt cache; drop any package files a hook left behind.
    for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()


def _content_bytes(rootfs: Path) -> int:
    """Bytes the rootfs occupies (``du``, apparent size rounded to 4 KiB blocks, plus one block per inode)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(rootfs):
        for name in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            total += -(-st.st_size // 4096) * 4096 + 256
    return total


def _mkfs(rootfs: Path, out: Path, size: int) -> None:
    fs = recipe.FILESYSTEM
    with open(out, "wb") as f:
        f.truncate(size)
    _run(
        ["mkfs.ext4", "-q", "-F", "-L", FS_LABEL, "-b", str(fs["block_size"]), "-i", str(fs["bytes_per_inode"]),
         "-I", str(fs["inode_size"]), "-d", str(rootfs), "-E", "root_owner=0:0", str(out)],
        "mkfs.ext4",
    )
    _run(["e2fsck", "-f", "-n", str(out)], "e2fsck")
    with open(out, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """``fsync`` the folder ``path``, so a rename into it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
