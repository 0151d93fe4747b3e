"""File extent maps through the ``FS_IOC_FIEMAP`` ioctl (see the kernel's
Documentation/filesystems/fiemap.rst).

An extent maps a run of a file's bytes (``logical``) to a run on the filesystem's device (``physical``), both
in bytes. Reflinked files map the same logical ranges to the same physical ranges, and XFS sets
``FIEMAP_EXTENT_SHARED`` on every extent whose blocks another file (or another offset) also uses. The map is
taken with ``FIEMAP_FLAG_SYNC`` so dirty data is written back first and no delayed-allocation extents appear.
"""

from __future__ import annotations

import fcntl
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sbx.storage.errors import StorageError

# _IOWR('f', 11, struct fiemap) from <linux/fs.h>; struct fiemap is 32 bytes, struct fiemap_extent 56 bytes.
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_MAX_OFFSET = 0xFFFFFFFFFFFFFFFF
FIEMAP_FLAG_SYNC = 0x1

FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNKNOWN = 0x2
FIEMAP_EXTENT_DELALLOC = 0x4
FIEMAP_EXTENT_ENCODED = 0x8
FIEMAP_EXTENT_UNWRITTEN = 0x800
FIEMAP_EXTENT_SHARED = 0x2000

# struct fiemap: fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, fm_reserved
_HEAD = struct.Struct("=QQLLLL")
_EXT = struct.Struct("=QQQQQLLLL")  # logical, physical, length, reserved64[2], flags, reserved[3]
_BATCH = 512


@dataclass(frozen=True)
class Extent:
    """One mapped run: ``logical`` / ``physical`` offsets and ``length``, all bytes; ``flags`` are the
    ``FIEMAP_EXTENT_*`` bits."""

    logical: int
    physical: int
    length: int
    flags: int

    @property
    def shared(self) -> bool:
        """The filesystem says another file (or offset) uses these blocks too."""
        return bool(self.flags & FIEMAP_EXTENT_SHARED)

    @property
    def unwritten(self) -> bool:
        """Allocated but never written (preallocated): reads as zeros."""
        return bool(self.flags & FIEMAP_EXTENT_UNWRITTEN)

    @property
    def end(self) -> int:
        return self.logical + self.length


def extents(path: str | os.PathLike[str]) -> list[Extent]:
    """Every extent of the file at ``path``, in logical order (holes are simply absent).

    Raises ``StorageError("not_found")`` for a missing file, ``StorageError("command_failed")`` when the
    filesystem does not support FIEMAP.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise StorageError("not_found", f"{path} does not exist") from e
    try:
        return list(_iter_extents(fd, str(path)))
    finally:
        os.close(fd)


def _iter_extents(fd: int, name: str) -> Iterator[Extent]:
    start = 0
    flags = FIEMAP_FLAG_SYNC
    while True:
        buf = bytearray(_HEAD.size + _BATCH * _EXT.size)
        _HEAD.pack_into(buf, 0, start, FIEMAP_MAX_OFFSET - start, flags, 0, _BATCH, 0)
        try:
            fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
        except OSError as e:
            raise StorageError("command_failed", f"FIEMAP on {name} failed: {e}") from e
        flags = 0  # synced once is enough
        mapped = _HEAD.unpack_from(buf, 0)[3]
        if mapped == 0:
            return
        last = None
        for i in range(mapped):
            fields = _EXT.unpack_from(buf, _HEAD.size + i * _EXT.size)
            logical, physical, length, eflags = fields[0], fields[1], fields[2], fields[5]
            last = Extent(logical, physical, length, eflags)
            yield last
        assert last is not None
        if last.flags & FIEMAP_EXTENT_LAST:
            return
        start = last.end


def merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sort half-open ``(start, end)`` byte ranges and join those that touch or overlap."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def subtract(ranges: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` without ``minus``; both must be merged (sorted, disjoint) lists of half-open ranges."""
    out: list[tuple[int, int]] = []
    j = 0
    for a, b in ranges:
        cur = a
        while j < len(minus) and minus[j][1] <= cur:
            j += 1
        k = j
        while k < len(minus) and minus[k][0] < b:
            ma, mb = minus[k]
            if ma > cur:
                out.append((cur, ma))
            cur = max(cur, mb)
            if cur >= b:
                break
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def total(ranges: Iterable[tuple[int, int]]) -> int:
    """Sum of the lengths of half-open ranges (bytes)."""
    return sum(b - a for a, b in ranges)
