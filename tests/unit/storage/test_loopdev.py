"""Loop devices that name no host path (issue 33, :mod:`sbx.storage.loopdev`): a disk bound by
:func:`sbx.storage.loopdev.attach` shows ``/<file name>`` as its backing file, is still found by its file
(:func:`sbx.storage.mounts.loop_devices_for`, ``losetup -j``), mounts, and honours read-only; a missing file is a
clear ``not_found``; the reflink volume is bound the same way."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sbx.config import Settings
from sbx.storage import disk, loopdev, mounts
from sbx.storage.errors import StorageError


def _image(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    img = folder / "disk.ext4"
    subprocess.run(["truncate", "-s", "64M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    return img


def test_attached_disk_names_only_its_file(tmp_path: Path) -> None:
    img = _image(tmp_path / "sandboxes" / "sb_0123456789")
    dev = loopdev.attach(img)
    try:
        name = dev.removeprefix("/dev/")
        assert Path(f"/sys/block/{name}/loop/backing_file").read_text().strip() == "/disk.ext4"
        assert Path(f"/sys/block/{name}/ro").read_text().strip() == "0"
        assert mounts.loop_devices_for(img) == [dev]
        found = subprocess.run(["losetup", "-j", str(img)], capture_output=True, text=True, check=True).stdout
        assert found.startswith(f"{dev}:") and "sb_0123456789" not in found
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)
    assert mounts.loop_devices_for(img) == []


def test_readonly_attach_and_disk_mount_use_it(tmp_path: Path) -> None:
    img = _image(tmp_path / "sb_abcdefghij")
    dev = loopdev.attach(img, readonly=True)
    try:
        assert Path(f"/sys/block/{dev.removeprefix('/dev/')}/ro").read_text().strip() == "1"
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)
    mp = tmp_path / "mnt"
    dev = disk.mount(img, mp)
    try:
        assert Path(f"/sys/block/{dev.removeprefix('/dev/')}/loop/backing_file").read_text().strip() == "/disk.ext4"
        assert disk.mounted_at(img) == mp.resolve()
    finally:
        disk.umount(mp)
    assert mounts.loop_devices_for(img) == []


def test_missing_file_is_not_found(tmp_path: Path) -> None:
    for missing in (tmp_path / "nope" / "disk.ext4", tmp_path / "disk.ext4"):
        with pytest.raises(StorageError) as e:
            loopdev.attach(missing)
        assert e.value.code == "not_found"


def test_the_volume_is_bound_by_name_only(vol: Path, settings: Settings) -> None:
    """The reflink volume's loop device (made by ``ensure_volume``) shows ``/volume.xfs``, not the host path of
    sbx's home."""
    [dev] = mounts.loop_devices_for(settings.volume_backing)
    text = Path(f"/sys/block/{dev.removeprefix('/dev/')}/loop/backing_file").read_text().strip()
    assert text == "/volume.xfs" and str(settings.home) not in text
