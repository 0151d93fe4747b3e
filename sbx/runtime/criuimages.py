"""Retargeting a CRIU memory image at another sandbox: its uid range and its hostname.

A memory image restores the user namespace with the uid/gid maps it was dumped with (``userns-<id>.img``: extents
``{first, lower_first, count}``), recreates the cgroup folders and files with their dumped host owners
(``cgroup.img``: ``cgroup_perms {mode, uid, gid}``) and the UTS namespace with the dumped hostname
(``utsns-<id>.img``: ``{nodename, domainname}``). A template or a fork is restored into a sandbox with a uid range
and a hostname of its own, so before the restore these are rewritten in the sandbox's own copy of the image: every
host id of the old range moves to the new one (credentials of the tasks are in-namespace ids and stay), and
``nodename`` becomes the new hostname. Measured here (issue 13): without the rewrite, a template dumped at one base
restored at another failed half of the time, "Unable to open tty-info.img: Permission denied" or "open_tree
.../systemd-private-...: Permission denied" (the restoring tasks ran as the OLD range, which may belong to another
sandbox by then); with it, every restore at a new base works, same PIDs and memory.

Image file layout (CRIU's images/ folder, "magic.h"): a u32 magic (``IMG_COMMON_MAGIC``, then the image's own
magic), then entries, each a little-endian u32 length followed by one protobuf message. The protobuf encoding is
done here by hand (varints and length-delimited fields only): the two messages have five fields between them, and
CRIU's ``crit`` is not installed on these hosts.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from sbx.runtime.base import RuntimeError_

IMG_COMMON_MAGIC = 0x54564319
UTSNS_MAGIC = 0x54473203


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _enc_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _fields(msg: bytes) -> list[tuple[int, int, int | bytes]]:
    """``(field number, wire type, value)`` of a protobuf message (wire types 0 varint and 2 bytes only)."""
    out: list[tuple[int, int, int | bytes]] = []
    i = 0
    while i < len(msg):
        key, i = _varint(msg, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(msg, i)
            out.append((num, wt, v))
        elif wt == 2:
            n, i = _varint(msg, i)
            out.append((num, wt, msg[i:i + n]))
            i += n
        else:
            raise ValueError(f"unexpected wire type {wt}")
    return out


def _encode(fields: list[tuple[int, int, int | bytes]]) -> bytes:
    out = bytearray()
    for num, wt, v in fields:
        out += _enc_varint(num << 3 | wt)
        if wt == 0:
            assert isinstance(v, int)
            out += _enc_varint(v)
        else:
            assert isinstance(v, bytes)
            out += _enc_varint(len(v)) + v
    return bytes(out)


def _read_entries(path: Path, magic: int | None) -> tuple[bytes, list[bytes]]:
    data = path.read_bytes()
    head = 8 if data[:4] == struct.pack("<I", IMG_COMMON_MAGIC) else 4
    if magic is not None and struct.unpack("<I", data[head - 4:head])[0] != magic:
        raise ValueError(f"{path.name}: unexpected magic")
    entries, i = [], head
    while i < len(data):
        (n,) = struct.unpack("<I", data[i:i + 4])
        entries.append(data[i + 4:i + 4 + n])
        i += 4 + n
    return data[:head], entries


def _write_entries(path: Path, head: bytes, entries: list[bytes]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head + b"".join(struct.pack("<I", len(e)) + e for e in entries))
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)


def _shift_message(msg: bytes, old_base: int, new_base: int) -> tuple[bytes, int]:
    """``msg`` with host ids of the range at ``old_base`` moved to ``new_base`` in every nested message shaped like
    ``cgroup_perms {mode, uid, gid}`` or ``uid_gid_extent {first, lower_first, count}`` (three varints numbered
    1-3): fields 2 and 3 within ``[old_base, old_base + 65536)`` move. Other length-delimited fields are parsed as
    nested messages when they parse, else kept as bytes. Returns the new message and how many ids moved."""
    try:
        fields = _fields(msg)
    except ValueError:
        return msg, 0
    moved = 0
    if len(fields) == 3 and [(n, w) for n, w, _v in fields] == [(1, 0), (2, 0), (3, 0)]:
        out: list[tuple[int, int, int | bytes]] = []
        for n, w, v in fields:
            assert isinstance(v, int)
            if n in (2, 3) and old_base <= v < old_base + RANGE:
                v, moved = v - old_base + new_base, moved + 1
            out.append((n, w, v))
        return _encode(out), moved
    out = []
    for n, w, v in fields:
        if w == 2 and isinstance(v, bytes) and v:
            sub, k = _shift_message(v, old_base, new_base)
            if k:
                v, moved = sub, moved + k
        out.append((n, w, v))
    return (_encode(out), moved) if moved else (msg, 0)


RANGE = 65536


def count_ids(image_dir: Path, base: int) -> int:
    """How many uid/gid fields of ``userns-*.img`` and ``cgroup.img`` in ``image_dir`` lie in the range at
    ``base`` (a check for tests and for :func:`retarget`: 0 afterwards for the old base)."""
    total = 0
    for p in _id_files(image_dir):
        _, entries = _read_entries(p, None)
        total += sum(_shift_message(e, base, base)[1] for e in entries)
    return total


def _id_files(image_dir: Path) -> list[Path]:
    return sorted(image_dir.glob("userns*.img")) + sorted(image_dir.glob("cgroup.img"))


def retarget(image_dir: Path, *, old_base: int, new_base: int, hostname: str | None) -> int:
    """Rewrite the memory image in ``image_dir`` so it restores into a sandbox whose uid/gid range starts at
    ``new_base`` (host ids; it was dumped at ``old_base``) and, when ``hostname`` is given, with that hostname in
    its UTS namespace. ``userns-*.img`` (the user namespace's maps) and ``cgroup.img`` (owners of the cgroup
    folders and files CRIU recreates) get every id of the old range moved; ``utsns-*.img`` its nodename. Each
    file is replaced atomically. Returns how many ids moved. Raises :class:`RuntimeError_` (op ``retarget``) when
    a file is damaged."""
    moved = 0
    try:
        if old_base != new_base:
            for p in _id_files(image_dir):
                head, entries = _read_entries(p, None)
                new_entries = []
                for e in entries:
                    sub, k = _shift_message(e, old_base, new_base)
                    new_entries.append(sub)
                    moved += k
                _write_entries(p, head, new_entries)
        if hostname is not None:
            name = hostname.encode()
            for u in sorted(image_dir.glob("utsns*.img")):
                head, entries = _read_entries(u, UTSNS_MAGIC)
                new_entries = []
                for e in entries:
                    f: list[tuple[int, int, int | bytes]] = [(n, w, name if n == 1 else v) for n, w, v in _fields(e)]
                    new_entries.append(_encode(f))
                _write_entries(u, head, new_entries)
    except (OSError, ValueError, struct.error) as e:
        raise RuntimeError_("retarget", f"memory image {image_dir}: {e}") from e
    return moved


OWN_TIME_NAMESPACE = "sbx-own-time-namespace"
"""A file in an image folder saying the dumped tasks ran in a time namespace of their own
(:func:`mark_own_time_namespace`)."""


def own_time_namespace(pid: int | None) -> bool:
    """True when process ``pid`` (a sandbox's init) runs in a time namespace other than this process's: the one
    CRIU made when it restored the sandbox from its own memory image (a resume keeps the dumped clocks' offsets).
    False when it can't be told (no pid, no ``/proc/PID/ns/time``)."""
    if not pid:
        return False
    try:
        return os.stat(f"/proc/{pid}/ns/time").st_ino != os.stat("/proc/self/ns/time").st_ino
    except OSError:
        return False


def mark_own_time_namespace(image_dir: Path, pid: int | None) -> None:
    """After a dump of the tasks under ``pid``: when they ran in a time namespace of their own
    (:func:`own_time_namespace`), say so in ``image_dir``, so :func:`drop_time_namespace` keeps the record (the
    dump names that namespace, and CRIU would read a missing image: "Unexpected EOF on (empty-image)")."""
    if own_time_namespace(pid):
        (image_dir / OWN_TIME_NAMESPACE).write_text("1\n")


def drop_time_namespace(image_dir: Path) -> bool:
    """Remove the time namespace record (``timens-*.img``) from the image in ``image_dir``, so CRIU restores the
    tasks in the host's time namespace instead of a new one with the dumped monotonic/boottime offsets; not when
    the dumped tasks ran in a time namespace of their own (:func:`mark_own_time_namespace`: a sandbox resumed from
    its own memory image), whose record the dump needs. Returns True when one was removed.

    Why (measured here, issue 13): with the record, the restored systemd and its services run in a time namespace
    of CRIU's, while a process started later by ``runc exec`` (which knows no time namespaces) runs in the host's;
    the next checkpoint then dumps, but its restore fails with "Can't restore sub-task in NS (cflags 80)"
    (CLONE_NEWTIME). A template or fork is restored on the host it was made on, so its clocks only move forward
    by the time since the dump, as after a suspend."""
    if (image_dir / OWN_TIME_NAMESPACE).exists():
        return False
    found = False
    for p in image_dir.glob("timens-*.img"):
        p.unlink()
        found = True
    return found
