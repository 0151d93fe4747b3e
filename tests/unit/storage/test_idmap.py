"""Idmapped mounts (:mod:`sbx.storage.idmap`) on a real small ext4 image, and the choice of uid ranges."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx.storage import idmap, mounts
from sbx.storage.errors import StorageError


def test_ranges_are_disjoint_and_lowest_free_is_picked() -> None:
    assert idmap.uid_base(0) == 1_000_000
    assert idmap.uid_base(1) - idmap.uid_base(0) == idmap.ID_MAP_SIZE
    assert idmap.lowest_free_base([]) == 1_000_000
    assert idmap.lowest_free_base([0, 1_000_000]) == 1_065_536
    # a gap left by a deleted sandbox is reused; values that are no range start are ignored
    assert idmap.lowest_free_base([1_000_000, 1_131_072, 1_000_001]) == 1_065_536
    with pytest.raises(ValueError):
        idmap.uid_base(-1)
    with pytest.raises(ValueError):
        idmap.uid_base(idmap.MAX_RANGES)
    assert idmap.uid_base(idmap.MAX_RANGES - 1) + idmap.ID_MAP_SIZE <= 2**32 - 1


def test_no_free_range_is_a_clear_error() -> None:
    every = [idmap.uid_base(k) for k in range(idmap.MAX_RANGES)]
    with pytest.raises(StorageError) as e:
        idmap.lowest_free_base(every)
    assert e.value.code == "no_uid_range"


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB ext4 image loop-mounted at ``tmp_path/plain`` (root-owned root directory with a file in it)."""
    if os.geteuid() != 0:
        pytest.fail("idmapped mounts need root")
    img, mp = tmp_path / "d.img", tmp_path / "plain"
    mp.mkdir()
    with img.open("wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(mp)], check=True)
    (mp / "hello").write_text("hi")
    os.chmod(mp, 0o777)
    try:
        yield mp
    finally:
        for m in sorted(mounts.mounts(), key=lambda m: len(str(m.mountpoint)), reverse=True):
            if str(m.mountpoint).startswith(str(tmp_path) + "/"):
                subprocess.run(["umount", str(m.mountpoint)], check=False)


def _create_as(uid: int, folder: Path, name: str) -> int:
    """Create ``folder/name`` in a child process running as ``uid:uid`` (through a folder fd opened here, since
    pytest's temp folders are 0700); returns 0 or the errno it failed with."""
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd))
            os._exit(0)
        except OSError as e:
            os._exit(e.errno or 1)
    os.close(dfd)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_idmapped_view_shifts_owners_both_ways(plain: Path, tmp_path: Path) -> None:
    view = tmp_path / "view"
    base = idmap.uid_base(3)
    idmap.idmapped_bind(plain, view, base)
    assert idmap.is_idmapped(view) and not idmap.is_idmapped(plain)
    assert (view / "hello").stat().st_uid == base and (plain / "hello").stat().st_uid == 0
    # host root has no mapping in the view: its writes fail there (they go through the plain mount)
    with pytest.raises(OSError) as e:
        (view / "from-host-root").write_text("x")
    assert e.value.errno == errno.EOVERFLOW
    # the sandbox's root (host uid base) writes through the view and the disk records 0
    assert _create_as(base + 1000, view, "made-inside") == 0
    assert (plain / "made-inside").stat().st_uid == 1000
    assert (view / "made-inside").stat().st_uid == base + 1000
    # a uid of another range is outside the map: it can't create files there
    assert _create_as(idmap.uid_base(4), view, "other-range") == errno.EOVERFLOW
    idmap.unmount(view)
    assert mounts.mount_at(view) is None
    idmap.unmount(view)  # nothing mounted: a no-op


def test_base_zero_is_a_plain_bind(plain: Path, tmp_path: Path) -> None:
    view = tmp_path / "view0"
    idmap.idmapped_bind(plain, view, 0)
    assert not idmap.is_idmapped(view)
    (view / "w").write_text("x")
    assert (plain / "w").stat().st_uid == 0
    idmap.unmount(view)


def test_userns_fd_maps_the_range() -> None:
    fd = idmap.userns_fd(idmap.uid_base(2))
    try:
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("user:[")
        assert os.readlink(f"/proc/self/fd/{fd}") != os.readlink("/proc/self/ns/user")
    finally:
        os.close(fd)


def test_missing_source_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(StorageError) as e:
        idmap.idmapped_bind(tmp_path / "nope", tmp_path / "v", idmap.uid_base(0))
    assert e.value.code == "idmap_failed"
    assert mounts.mount_at(tmp_path / "v") is None
