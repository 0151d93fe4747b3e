"""Checkpoint deltas: export on one volume, import on another, byte-identical result."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from storage_helpers import HOME, MiB, sha256, write_random

from sbx.config import Settings
from sbx.storage import delta, disk, reflink, space, volume
from sbx.storage import seals as seals_mod
from sbx.storage.errors import StorageError


@pytest.fixture(scope="module")
def other_vol(vol: Path) -> Iterator[Path]:
    """A second, separate reflink volume (another filesystem: physical block numbers mean nothing there)."""
    s = Settings(home=HOME / "sbx-storagetest-other", volume_size_gib=4, node_name="o")
    volume.ensure_volume(s)
    try:
        yield s.node_dir
    finally:
        volume.unmount_volume(s, remove_backing=True)
        shutil.rmtree(s.home, ignore_errors=True)


def test_delta_round_trip_between_volumes(
    work: Path, base_image: Path, other_vol: Path, mnt: Callable[[str], Path]
) -> None:
    d = disk.create_disk(base_image, work / "d.ext4", 1024)
    seals = work / "seals"
    m = mnt("delta")
    disk.mount(d, m)
    write_random(m / "big.bin", 48 * MiB)
    write_random(m / "doomed.bin", 8 * MiB)
    disk.umount(m)
    s1 = seals_mod.seal(d, seals)
    disk.mount(d, m)
    write_random(m / "new.bin", 2 * MiB)
    write_random(m / "big.bin", MiB, offset=10 * MiB)  # overwrite 1 MiB in place
    (m / "doomed.bin").unlink()
    disk.umount(m)
    s2 = seals_mod.seal(d, seals)

    full = delta.export_delta(s1, None, work / "1.full.delta")
    inc = delta.export_delta(s2, s1, work / "2.delta")
    assert full.full and not inc.full
    assert full.data_bytes >= 56 * MiB
    # the incremental delta holds the changed data and some filesystem metadata, far less than the disk
    assert 3 * MiB <= inc.data_bytes < 12 * MiB
    assert inc.file_bytes < 16 * MiB
    assert inc.file_bytes < space.allocated_bytes(s2.path) / 4
    assert delta.read_header(inc.path)["parent"]["seq"] == 1

    # carry the files to the other volume and rebuild the chain there
    shutil.copy(full.path, other_vol / "1.full.delta")
    shutil.copy(inc.path, other_vol / "2.delta")
    r1 = delta.import_delta(None, other_vol / "1.full.delta", other_vol / "1.ext4")
    r2 = delta.import_delta(r1, other_vol / "2.delta", other_vol / "2.ext4")
    assert sha256(r1) == sha256(s1.path)
    assert sha256(r2) == sha256(s2.path)
    # the rebuilt child shares its unchanged blocks with the rebuilt parent
    assert space.unique_bytes(r2, [r1]) < 16 * MiB
    assert not (other_vol / "2.ext4.partial").exists()


def test_delta_of_plain_files_with_holes_punched_and_growth(work: Path) -> None:
    import ctypes
    import os

    parent = work / "p.img"
    with open(parent, "wb") as f:
        f.truncate(16 * MiB)
    write_random(parent, 8 * MiB)
    child = reflink.clone(parent, work / "c.img")
    fd = os.open(child, os.O_RDWR)
    try:  # a discard inside the guest: the child has a hole where the parent has data
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        assert libc.fallocate(fd, 0x03, 2 * MiB, MiB) == 0
    finally:
        os.close(fd)
    write_random(child, 4096, offset=5 * MiB)
    os.truncate(child, 24 * MiB)
    write_random(child, 8192, offset=20 * MiB)

    info = delta.export_delta(child, parent, work / "c.delta")
    assert info.zero_bytes == MiB
    assert info.data_bytes == 4096 + 8192
    assert info.image_bytes == 24 * MiB
    out = delta.import_delta(parent, info.path, work / "c2.img")
    assert sha256(out) == sha256(child)
    assert out.stat().st_size == 24 * MiB


def test_import_rejects_bad_deltas(work: Path) -> None:
    parent = work / "p.img"
    write_random(parent, 2 * MiB)
    child = reflink.clone(parent, work / "c.img")
    write_random(child, MiB, offset=MiB // 2)
    good = delta.export_delta(child, parent, work / "c.delta").path
    raw = good.read_bytes()

    def expect_bad(data: bytes, parent_image: Path | None = parent, code: str = "bad_delta") -> None:
        p = work / "bad.delta"
        p.write_bytes(data)
        with pytest.raises(StorageError) as e:
            delta.import_delta(parent_image, p, work / "out.img")
        assert e.value.code == code
        assert not (work / "out.img").exists() and not (work / "out.img.partial").exists()
        p.unlink()

    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0xFF
    expect_bad(bytes(flipped))  # checksum
    expect_bad(raw[: len(raw) - 100])  # truncated
    expect_bad(b"NOTDELTA" + raw[8:])  # magic
    expect_bad(raw, parent_image=None)  # incremental without its parent
    other = work / "other.img"
    write_random(other, 3 * MiB)
    expect_bad(raw, parent_image=other)  # another parent
    expect_bad(raw, parent_image=work / "missing.img", code="not_found")
    with pytest.raises(StorageError) as e:
        delta.export_delta(child, parent, good)
    assert e.value.code == "exists"
    # the good one still imports
    assert sha256(delta.import_delta(parent, good, work / "ok.img")) == sha256(child)
