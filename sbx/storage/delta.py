"""Incremental export and import of sealed disk images (checkpoint deltas), to move a seal chain to another
volume or host.

Which blocks go into a delta: the extent maps (FIEMAP) of the child and its parent seal, both on one reflink
volume. A child extent that maps a logical range to the *same physical blocks* as the parent at the same
logical offset is unchanged (it is still the shared reflinked data); everything else the child maps with data
goes in as a data record. Ranges where the parent has data but the child has none (a hole or an unwritten
extent, e.g. after a discard) go in as zero records. No block is read to decide this, so export time is
proportional to the changed data, not to the disk size. Without a parent the delta holds every data extent (a
full export; holes stay holes).

File format (little-endian), version 1::

    b"SBXDELTA"  u16 version=1  u16 0  u32 n   header: n bytes of UTF-8 JSON
        {"version": 1, "size_bytes": child length, "parent": null | {"size_bytes": int, "seq": int|null,
         "created_at": str|null}, "method": "fiemap-physical"}
    records, each  u8 kind  u64 offset  u64 length  (bytes)
        kind b"D": followed by ``length`` bytes to write at ``offset``
        kind b"Z": ``offset``..``offset+length`` reads as zeros (punched as a hole on import)
        kind b"E": end; offset = number of D/Z records before it, length = total D payload bytes
    trailer: 32 bytes, SHA-256 of every byte before it.

Import (:func:`import_delta`) reflinks the parent image, sets the child's length, applies the records into a
``.partial`` file, checks the trailer and renames the result into place, so a bad delta leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from sbx.storage import fiemap
from sbx.storage.errors import StorageError
from sbx.storage.reflink import clone
from sbx.storage.seals import Seal

MAGIC = b"SBXDELTA"
VERSION = 1
_PREFIX = struct.Struct("<8sHHI")
_RECORD = struct.Struct("<cQQ")
_CHUNK = 4 * 1024 * 1024
_MAX_HEADER = 1024 * 1024

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class DeltaInfo:
    """What :func:`export_delta` wrote: ``path``; ``file_bytes`` (the delta file's length); ``data_bytes``
    (payload of data records); ``zero_bytes`` (length of zero records); ``records`` (data + zero records);
    ``image_bytes`` (the child image's length); ``full`` (True without a parent)."""

    path: Path
    file_bytes: int
    data_bytes: int
    zero_bytes: int
    records: int
    image_bytes: int
    full: bool


def _image(x: Seal | PathLike) -> tuple[Path, dict[str, Any]]:
    if isinstance(x, Seal):
        return x.path, {"seq": x.seq, "created_at": x.created_at}
    return Path(x), {"seq": None, "created_at": None}


def _data_extents(path: Path, size: int) -> list[fiemap.Extent]:
    """Extents holding data (unwritten ones read as zeros, so they count as holes), clipped to ``size``."""
    out = []
    for e in fiemap.extents(path):
        if e.unwritten or e.logical >= size:
            continue
        length = min(e.end, size) - e.logical
        out.append(fiemap.Extent(e.logical, e.physical, length, e.flags))
    return out


def _same_blocks(child: list[fiemap.Extent], parent: list[fiemap.Extent]) -> list[tuple[int, int]]:
    """Logical ranges where child and parent map the same offset to the same physical block."""
    shared: list[tuple[int, int]] = []
    j = 0
    for c in child:
        while j < len(parent) and parent[j].end <= c.logical:
            j += 1
        k = j
        while k < len(parent) and parent[k].logical < c.end:
            p = parent[k]
            if p.physical - p.logical == c.physical - c.logical:
                shared.append((max(c.logical, p.logical), min(c.end, p.end)))
            k += 1
    return fiemap.merge(shared)


def export_delta(seal: Seal | PathLike, parent_seal: Seal | PathLike | None, out_path: PathLike) -> DeltaInfo:
    """Write the blocks of ``seal`` that differ from ``parent_seal`` (or all of its data when the parent is
    None) to a new delta file at ``out_path``; see the module doc for how blocks are chosen and the format.

    Both images must be sealed (not written while this runs) and, for an incremental delta, on the same
    filesystem; a parent on another filesystem shares nothing, so every child extent is exported.

    Raises ``StorageError``: ``not_found``, ``exists`` (``out_path`` exists; nothing is overwritten).
    """
    child, _ = _image(seal)
    if not child.exists():
        raise StorageError("not_found", f"{child} does not exist")
    size = child.stat().st_size
    child_ext = _data_extents(child, size)
    child_ranges = fiemap.merge((e.logical, e.end) for e in child_ext)
    parent_meta: dict[str, Any] | None = None
    zero: list[tuple[int, int]] = []
    data = child_ranges
    if parent_seal is not None:
        parent, meta = _image(parent_seal)
        if not parent.exists():
            raise StorageError("not_found", f"{parent} does not exist")
        psize = parent.stat().st_size
        parent_meta = {"size_bytes": psize, **meta}
        parent_ext = _data_extents(parent, min(psize, size))
        if parent.stat().st_dev == child.stat().st_dev:
            data = fiemap.subtract(child_ranges, _same_blocks(child_ext, parent_ext))
        zero = fiemap.subtract(fiemap.merge((e.logical, e.end) for e in parent_ext), child_ranges)

    header = json.dumps(
        {"version": VERSION, "size_bytes": size, "parent": parent_meta, "method": "fiemap-physical"},
        sort_keys=True,
    ).encode()
    records = sorted([(a, b, b"D") for a, b in data] + [(a, b, b"Z") for a, b in zero])
    out = Path(out_path)
    try:
        f = open(out, "xb")
    except FileExistsError as e:
        raise StorageError("exists", f"{out} already exists") from e
    h = hashlib.sha256()

    def put(b: bytes) -> None:
        h.update(b)
        f.write(b)

    try:
        with f, open(child, "rb", buffering=0) as src:
            put(_PREFIX.pack(MAGIC, VERSION, 0, len(header)))
            put(header)
            payload = 0
            for a, b, kind in records:
                put(_RECORD.pack(kind, a, b - a))
                if kind == b"D":
                    pos = a
                    while pos < b:
                        chunk = os.pread(src.fileno(), min(_CHUNK, b - pos), pos)
                        if not chunk:
                            raise StorageError("command_failed", f"{child} shrank while being exported")
                        put(chunk)
                        pos += len(chunk)
                    payload += b - a
            put(_RECORD.pack(b"E", len(records), payload))
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return DeltaInfo(
        path=out,
        file_bytes=out.stat().st_size,
        data_bytes=fiemap.total(data),
        zero_bytes=fiemap.total(zero),
        records=len(records),
        image_bytes=size,
        full=parent_seal is None,
    )


class _Reader:
    """Reads a delta file while hashing it; short reads are a truncated delta."""

    def __init__(self, f: BinaryIO, name: str):
        self.f, self.name, self.h = f, name, hashlib.sha256()

    def read(self, n: int, *, hashed: bool = True) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise StorageError("bad_delta", f"{self.name} is truncated")
        if hashed:
            self.h.update(b)
        return b


def read_header(delta_path: PathLike) -> dict[str, Any]:
    """The JSON header of a delta file (see the module doc). Raises ``StorageError("bad_delta")``,
    ``not_found``."""
    try:
        with open(delta_path, "rb") as f:
            return _read_header(_Reader(f, str(delta_path)))
    except FileNotFoundError as e:
        raise StorageError("not_found", f"{delta_path} does not exist") from e


def _read_header(r: _Reader) -> dict[str, Any]:
    magic, version, _, n = _PREFIX.unpack(r.read(_PREFIX.size))
    if magic != MAGIC:
        raise StorageError("bad_delta", f"{r.name} is not an sbx delta file")
    if version != VERSION:
        raise StorageError("bad_delta", f"{r.name} has format version {version}; this sbx reads {VERSION}")
    if n > _MAX_HEADER:
        raise StorageError("bad_delta", f"{r.name} has an oversized header")
    try:
        header: dict[str, Any] = json.loads(r.read(n))
        int(header["size_bytes"])
    except (ValueError, KeyError, TypeError) as e:
        raise StorageError("bad_delta", f"{r.name} has a corrupt header") from e
    return header


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _punch(fd: int, offset: int, length: int) -> None:
    """Make ``offset..offset+length`` a hole (reads as zeros); falls back to writing zeros."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return
    zeros = bytes(min(_CHUNK, length))
    pos = offset
    while pos < offset + length:
        pos += os.pwrite(fd, zeros[: min(len(zeros), offset + length - pos)], pos)


def import_delta(parent_image: PathLike | None, delta_path: PathLike, out_path: PathLike, *, mode: int = 0o644) -> Path:
    """Rebuild the child image of a delta at ``out_path``: a reflink copy of ``parent_image`` (or an empty
    sparse file for a full delta, whose parent is then not needed and ignored), with the delta's records
    applied, and permission ``mode``. The result is byte-identical to the exported image. ``parent_image``
    must be on ``out_path``'s reflink filesystem.

    Raises ``StorageError``: ``not_found``, ``exists`` (``out_path``), ``bad_delta`` (corrupt, truncated,
    wrong version, checksum mismatch, a record outside the image, or ``parent_image`` of another length than
    the delta's parent; also when an incremental delta gets no parent), ``no_reflink``. Nothing is left at
    ``out_path`` on failure.
    """
    out = Path(out_path)
    if out.exists():
        raise StorageError("exists", f"{out} already exists")
    tmp = out.with_name(out.name + ".partial")
    tmp.unlink(missing_ok=True)
    try:
        f = open(delta_path, "rb")
    except FileNotFoundError as e:
        raise StorageError("not_found", f"{delta_path} does not exist") from e
    try:
        with f:
            r = _Reader(f, str(delta_path))
            header = _read_header(r)
            size = int(header["size_bytes"])
            parent_meta = header.get("parent")
            if parent_meta is not None:
                if parent_image is None:
                    raise StorageError("bad_delta", f"{delta_path} is incremental: it needs its parent image")
                pp = Path(parent_image)
                if not pp.exists():
                    raise StorageError("not_found", f"parent image {pp} does not exist")
                if pp.stat().st_size != int(parent_meta["size_bytes"]):
                    raise StorageError(
                        "bad_delta",
                        f"{pp} is {pp.stat().st_size} bytes; {delta_path} was made against a parent of "
                        f"{parent_meta['size_bytes']} bytes",
                    )
                clone(pp, tmp, mode=0o600)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            fd = os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                count = payload = 0
                while True:
                    kind, offset, length = _RECORD.unpack(r.read(_RECORD.size))
                    if kind == b"E":
                        if offset != count or length != payload:
                            raise StorageError("bad_delta", f"{delta_path}: record count or size mismatch")
                        break
                    if kind not in (b"D", b"Z") or offset + length > size:
                        raise StorageError("bad_delta", f"{delta_path}: bad record at image offset {offset}")
                    count += 1
                    if kind == b"Z":
                        _punch(fd, offset, length)
                        continue
                    payload += length
                    pos = offset
                    while pos < offset + length:
                        chunk = r.read(min(_CHUNK, offset + length - pos))
                        os.pwrite(fd, chunk, pos)
                        pos += len(chunk)
                digest = r.read(32, hashed=False)
                if digest != r.h.digest() or f.read(1):
                    raise StorageError("bad_delta", f"{delta_path}: checksum mismatch")
                os.fchmod(fd, mode)
                os.fsync(fd)
            finally:
                os.close(fd)
        os.rename(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
