"""Read what is mounted and which loop device backs which file, from ``/proc/self/mountinfo`` and
``/sys/block/loop*/loop/backing_file`` (no parsing of ``mount``/``losetup`` output)."""

from __future__ import annotations

import fcntl
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

# <linux/loop.h>: LOOP_GET_STATUS64 fills a struct loop_info64 (232 bytes; lo_device, lo_inode first).
_LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64_SIZE = 232

_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo`` octal."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo: ``mountpoint`` (absolute), ``fstype``, ``source`` (``/dev/loop3``, ...),
    ``options`` (per-mount options, comma-separated), ``root`` (the subtree of the fs mounted there)."""

    mountpoint: Path
    fstype: str
    source: str
    options: str
    root: str


def mounts() -> list[MountEntry]:
    """Every mount in this process's mount namespace, in mount order."""
    out: list[MountEntry] = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.rstrip("\n").partition(" - ")
            lf, rf = left.split(" "), right.split(" ")
            if len(lf) < 6 or len(rf) < 2:
                continue
            out.append(
                MountEntry(
                    mountpoint=Path(_unescape(lf[4])),
                    fstype=rf[0],
                    source=_unescape(rf[1]),
                    options=lf[5],
                    root=_unescape(lf[3]),
                )
            )
    return out


def mount_at(mountpoint: str | os.PathLike[str]) -> MountEntry | None:
    """The topmost mount at ``mountpoint`` (symlinks resolved), or None when nothing is mounted there."""
    mp = Path(os.path.realpath(mountpoint))
    found = None
    for m in mounts():
        if m.mountpoint == mp:
            found = m
    return found


def loop_backing(device: str) -> Path | None:
    """The file behind loop device ``device`` (``/dev/loop3`` or ``loop3``), or None when it is not a bound
    loop device. A backing file deleted since shows with its old path."""
    name = os.path.basename(device)
    try:
        text = Path(f"/sys/block/{name}/loop/backing_file").read_text().rstrip("\n")
    except OSError:
        return None
    if text.endswith(" (deleted)"):
        text = text[: -len(" (deleted)")]
    return Path(text)


def _loop_status(device: str) -> tuple[int, int] | None:
    """``(lo_device, lo_inode)`` of a bound loop device from ``LOOP_GET_STATUS64``, or None when unbound."""
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        buf = bytearray(_LOOP_INFO64_SIZE)
        fcntl.ioctl(fd, _LOOP_GET_STATUS64, buf)
    except OSError:
        return None
    finally:
        os.close(fd)
    lo_device, lo_inode = struct.unpack_from("=QQ", buf, 0)
    return lo_device, lo_inode


def loop_devices_for(path: str | os.PathLike[str]) -> list[str]:
    """Loop devices (``/dev/loopN``) bound to the file at ``path``, matched by the device and inode numbers
    the kernel keeps for the loop (``LOOP_GET_STATUS64``), so a renamed file still matches; empty when none or
    when ``path`` does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    found = []
    for entry in sorted(Path("/sys/block").glob("loop*"), key=lambda p: int(p.name[4:] or 0)):
        if not (entry / "loop").exists():  # the "loop" folder exists only while a file is bound
            continue
        status = _loop_status(f"/dev/{entry.name}")
        if status and status[1] == st.st_ino and status[0] == st.st_dev:
            found.append(f"/dev/{entry.name}")
    return found


def mountpoints_of(source: str) -> list[Path]:
    """Mount points where block device ``source`` is mounted (bind mounts included)."""
    return [m.mountpoint for m in mounts() if m.source == source]


def holders(device: str) -> dict[int, list[Path]]:
    """Mount namespaces other than this process's that still mount block ``device`` (``/dev/loop3``), as
    ``{pid: [mountpoints]}`` with one process per namespace: copies a ``clone(CLONE_NEWNS)``/``unshare -m`` made
    while the device was mounted here, which keep its filesystem alive after this namespace unmounts it (with
    private propagation nothing takes the unmount there: mount_namespaces(7)). Matched by the device number in
    each ``/proc/PID/mountinfo``; processes that vanish meanwhile are skipped. Empty when the device is gone."""
    try:
        rdev = os.stat(device).st_rdev
    except OSError:
        return {}
    want = f"{os.major(rdev)}:{os.minor(rdev)}"
    try:
        mine = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return {}
    seen: set[int] = {mine}
    out: dict[int, list[Path]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            ns = os.stat(f"/proc/{pid}/ns/mnt").st_ino
            if ns in seen:
                continue
            with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
                points = [Path(_unescape(fields[4])) for fields in (ln.split(" ") for ln in f)
                          if len(fields) > 4 and fields[2] == want]
        except OSError:
            continue
        seen.add(ns)
        if points:
            out[pid] = points
    return out
