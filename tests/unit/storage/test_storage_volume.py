"""The reflink XFS volume: made once, mounted again (never re-made), reported for ``sbx doctor``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from storage_helpers import HOME

from sbx.config import Settings
from sbx.storage import mounts, reflink, volume
from sbx.storage.errors import StorageError

GiB = 1024**3


def test_volume_is_mounted_xfs_with_reflink(vol: Path, settings: Settings) -> None:
    assert volume.ensure_volume(settings) == vol  # idempotent
    st = volume.volume_status(settings)
    assert st["mounted"] and st["reflink"]
    assert st["fstype"] == "xfs"
    assert st["source"].startswith("/dev/loop")
    assert 29 * GiB < st["size_bytes"] <= 30 * GiB
    assert 0 < st["free_bytes"] < st["size_bytes"]
    # sparse: the 30 GiB backing file takes a small part of that on the host
    assert st["backing_allocated_bytes"] < 1 * GiB
    for d in ("images", "nodes", "nodes/storagetest"):
        assert (vol / d).is_dir()


def test_volume_is_remounted_not_remade_and_grows(vol: Path) -> None:
    other = Settings(home=HOME / "sbx-storagetest-v2", volume_size_gib=1, node_name="n")
    try:
        path = volume.ensure_volume(other)
        (path / "images" / "marker").write_text("kept")
        volume.unmount_volume(other)
        st = volume.volume_status(other)
        assert not st["mounted"] and st["size_bytes"] == 0
        assert mounts.loop_devices_for(other.volume_backing) == []  # the loop device went with the unmount

        bigger = Settings(home=other.home, volume_size_gib=2, node_name="n")
        volume.ensure_volume(bigger)
        assert (path / "images" / "marker").read_text() == "kept"  # same filesystem, not re-made
        assert volume.volume_status(bigger)["size_bytes"] > 1.5 * GiB  # grown to the new size

        # a loop device left bound to the backing file (crash after losetup) is reused, not doubled
        volume.unmount_volume(bigger)
        left = subprocess.run(
            ["losetup", "--find", "--show", str(other.volume_backing)], capture_output=True, text=True, check=True
        ).stdout.strip()
        volume.ensure_volume(bigger)
        assert volume.volume_status(bigger)["source"] == left
        assert mounts.loop_devices_for(other.volume_backing) == [left]
        assert (path / "images" / "marker").read_text() == "kept"
    finally:
        volume.unmount_volume(other, remove_backing=True)
        shutil.rmtree(other.home, ignore_errors=True)


def test_volume_refuses_a_backing_file_with_another_filesystem(vol: Path) -> None:
    other = Settings(home=HOME / "sbx-storagetest-v3", volume_size_gib=1)
    try:
        other.home.mkdir(parents=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(other.volume_backing), "64M"], check=True, capture_output=True)
        with pytest.raises(StorageError) as e:
            volume.ensure_volume(other)
        assert e.value.code == "volume_failed"
        assert not volume.volume_status(other)["mounted"]
    finally:
        volume.unmount_volume(other, remove_backing=True)
        shutil.rmtree(other.home, ignore_errors=True)


def test_status_of_a_missing_volume() -> None:
    st = volume.volume_status(Settings(home=HOME / "sbx-storagetest-none"))
    assert st["mounted"] is False and st["reflink"] is False and st["size_bytes"] == 0


def test_host_ext4_has_no_reflink_and_clone_never_copies(vol: Path) -> None:
    d = HOME / "sbx-storagetest-ext4"
    d.mkdir(parents=True, exist_ok=True)
    try:
        assert not reflink.supports_reflink(d)
        (d / "a").write_bytes(b"x" * 8192)
        with pytest.raises(StorageError) as e:
            reflink.clone(d / "a", d / "b")
        assert e.value.code == "no_reflink"
        assert not (d / "b").exists()
        # across filesystems (host ext4 -> volume) is refused the same way
        with pytest.raises(StorageError) as e:
            reflink.clone(d / "a", vol / "nodes" / "sbx-storagetest-cross")
        assert e.value.code == "no_reflink"
        assert not (vol / "nodes" / "sbx-storagetest-cross").exists()
    finally:
        shutil.rmtree(d)
