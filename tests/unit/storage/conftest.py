"""Fixtures for the storage tests: a throwaway reflink volume under /var/lib/sbx-storagetest (root needed).

Everything these tests make on the host is named ``sbx-storagetest*``: the home folder (volume backing file and
mount point inside it), disk mount points under ``<home>/mnt``, and a second small volume for imports. The
session fixture unmounts and deletes all of it at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from storage_helpers import HOME

from sbx.config import Settings
from sbx.storage import disk, mounts, volume

MiB = 1024 * 1024


def _cleanup_mounts(under: Path, keep: tuple[Path, ...] = ()) -> None:
    """Unmount every disk mounted under ``under`` (deepest first) except ``keep``, thawing if frozen."""
    for m in sorted(mounts.mounts(), key=lambda m: len(str(m.mountpoint)), reverse=True):
        if str(m.mountpoint).startswith(str(under) + "/") and m.mountpoint not in keep:
            subprocess.run(["fsfreeze", "-u", str(m.mountpoint)], capture_output=True, check=False)
            disk.umount(m.mountpoint)


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings(home=HOME, volume_size_gib=30, node_name="storagetest", state_dir=HOME / "server")


@pytest.fixture(scope="session")
def vol(settings: Settings) -> Iterator[Path]:
    """The mounted test volume (made by ``ensure_volume``); removed after the session."""
    assert os.geteuid() == 0, "the storage tests need root: they make loop devices and mounts"
    path = volume.ensure_volume(settings)
    try:
        yield path
    finally:
        _cleanup_mounts(HOME, keep=(path,))
        _cleanup_mounts(path)
        volume.unmount_volume(settings, remove_backing=True)
        shutil.rmtree(HOME, ignore_errors=True)


@pytest.fixture
def work(vol: Path, settings: Settings, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh folder on the volume for one test (``nodes/storagetest/<test name>``), removed afterwards."""
    d = settings.node_dir / request.node.name.replace("[", "-").replace("]", "")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    yield d
    _cleanup_mounts(HOME / "mnt")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def mnt(vol: Path) -> Iterator[Callable[[str], Path]]:
    """A factory of mount points ``<home>/mnt/sbx-storagetest-<name>``; anything mounted there is unmounted
    after the test."""
    made: list[Path] = []

    def make(name: str) -> Path:
        p = HOME / "mnt" / f"sbx-storagetest-{name}"
        p.mkdir(parents=True, exist_ok=True)
        made.append(p)
        return p

    yield make
    for p in made:
        subprocess.run(["fsfreeze", "-u", str(p)], capture_output=True, check=False)
        disk.umount(p)


@pytest.fixture(scope="session")
def base_image(vol: Path, settings: Settings) -> Path:
    """A 64 MiB ext4 base image (metadata_csum on, as mkfs.ext4 does by default) holding a few files."""
    src = HOME / "sbx-storagetest-base-root"
    (src / "etc").mkdir(parents=True, exist_ok=True)
    (src / "etc" / "hostname").write_text("base\n")
    (src / "data.bin").write_bytes(os.urandom(4 * MiB))
    img = settings.images_dir / "sbx-storagetest-base.ext4"
    img.unlink(missing_ok=True)
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-L", "sbxbase", "-d", str(src), str(img), "64M"], check=True, capture_output=True
    )
    shutil.rmtree(src)
    return img
