"""Space accounting for reflinked disk images, from their extent maps (FIEMAP).

On a reflink volume ``du`` counts shared blocks once per file, so it over-states what a disk or snapshot
costs. Here ``allocated_bytes`` is what a file maps, and ``unique_bytes`` is what removing it would give back
if the only other users of its blocks were the given files. The volume's own totals come from ``statvfs``
(:func:`sbx.storage.volume.volume_status`); XFS frees a block when its last user goes, so deleting a disk or
seal frees exactly its blocks that nothing else shares.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from sbx.storage import fiemap


def allocated_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the volume mapped by the file at ``path`` (data and preallocated extents; holes count 0),
    shared blocks included. Raises ``StorageError("not_found")``."""
    return sum(e.length for e in fiemap.extents(path))


def _physical(path: str | os.PathLike[str]) -> list[tuple[int, int]]:
    return fiemap.merge((e.physical, e.physical + e.length) for e in fiemap.extents(path))


def unique_bytes(path: str | os.PathLike[str], others: Iterable[str | os.PathLike[str]] = ()) -> int:
    """Bytes of ``path``'s extents that none of ``others`` maps (compared by physical range on the device).

    Extents the filesystem does not flag ``FIEMAP_EXTENT_SHARED`` are unique without comparing. Blocks shared
    with a file that is not in ``others`` count as unique. Files in ``others`` that are missing or on another
    filesystem are ignored. Raises ``StorageError("not_found")`` when ``path`` is missing.
    """
    own = fiemap.extents(path)
    dev = os.stat(path).st_dev
    unshared = sum(e.length for e in own if not e.shared)
    shared = fiemap.merge((e.physical, e.physical + e.length) for e in own if e.shared)
    if not shared:
        return unshared
    theirs: list[tuple[int, int]] = []
    me = Path(path).resolve()
    for other in others:
        op = Path(other)
        try:
            if op.resolve() == me or os.stat(op).st_dev != dev:
                continue
        except OSError:
            continue
        theirs.extend(_physical(op))
    return unshared + fiemap.total(fiemap.subtract(shared, fiemap.merge(theirs)))


def shared_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of ``path``'s extents the filesystem reports as shared with anything."""
    return sum(e.length for e in fiemap.extents(path) if e.shared)
