"""Space accounting with FIEMAP, and what deleting a disk gives back (statfs of the volume)."""

from __future__ import annotations

from pathlib import Path

from storage_helpers import MiB, freed_after, used_bytes, write_random

from sbx.storage import disk, reflink, space


def test_unique_bytes_through_clone_and_write(work: Path) -> None:
    a = work / "a.img"
    with open(a, "wb") as f:
        f.truncate(256 * MiB)
    write_random(a, 32 * MiB)
    assert space.allocated_bytes(a) == 32 * MiB
    assert space.unique_bytes(a) == 32 * MiB  # nothing else uses its blocks

    b = reflink.clone(a, work / "b.img")
    assert space.unique_bytes(a, [b]) == 0  # all shared after the clone
    assert space.unique_bytes(b, [a]) == 0
    # shared with b, but b is not in the comparison set: counts as unique to a
    assert space.unique_bytes(a, []) == 32 * MiB

    write_random(b, 4 * MiB, offset=8 * MiB)
    assert space.unique_bytes(b, [a]) == 4 * MiB
    assert space.unique_bytes(a, [b]) == 4 * MiB  # the old copy of those blocks is a's alone now
    assert space.allocated_bytes(b) == 32 * MiB

    c = reflink.clone(b, work / "c.img")
    assert space.unique_bytes(b, [a, c]) == 0
    assert space.unique_bytes(b, [a]) == 4 * MiB


def test_delete_frees_only_unshared_blocks(work: Path) -> None:
    a = work / "a.img"
    write_random(a, 64 * MiB)
    b = reflink.clone(a, work / "b.img")
    write_random(b, 8 * MiB, offset=16 * MiB)

    before = used_bytes(work)
    disk.remove_disk(b)
    freed_b = freed_after(work, before, at_least=7 * MiB)
    assert 7 * MiB < freed_b < 9 * MiB  # b's own 8 MiB, not its 64 MiB of shared data

    before = used_bytes(work)
    disk.remove_disk(a)
    freed_a = freed_after(work, before, at_least=63 * MiB)
    assert 63 * MiB < freed_a < 65 * MiB  # last user gone: everything
