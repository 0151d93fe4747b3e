"""The disk's two mounts (:func:`sbx.node.rootfs.mount_root` / :func:`~sbx.node.rootfs.umount_root`) on a real
small ext4 image: made, repaired after a crash left one of them, and taken down with the loop device; the folder
permissions of :func:`~sbx.node.rootfs.make_private`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from sbx.node import rootfs
from sbx.storage import idmap, mounts


@pytest.fixture
def image(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.fail("mounting disks needs root")
    img = tmp_path / "disk.ext4"
    with img.open("wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", str(img)], check=True)
    return img


def test_mount_repair_and_unmount(image: Path, tmp_path: Path) -> None:
    host, view = tmp_path / "b" / "disk", tmp_path / "b" / "rootfs"
    base = idmap.uid_base(9)
    try:
        rootfs.mount_root(image, host, view, base)
        assert idmap.is_idmapped(view) and not idmap.is_idmapped(host)
        (host / "f").write_text("x")
        assert (view / "f").stat().st_uid == base and (host / "f").stat().st_uid == 0
        rootfs.mount_root(image, host, view, base)  # both there: nothing changes
        assert len(mounts.mountpoints_of(mounts.loop_devices_for(image)[0])) == 2
        idmap.unmount(view)  # a crash between the two mounts (or a host reboot) left only the plain one
        rootfs.mount_root(image, host, view, base)
        assert idmap.is_idmapped(view) and (view / "f").read_text() == "x"
    finally:
        rootfs.umount_root(image, view)
    assert mounts.mount_at(host) is None and mounts.mount_at(view) is None
    assert mounts.loop_devices_for(image) == []


def test_make_private(tmp_path: Path) -> None:
    d = tmp_path / "sb"
    d.mkdir()
    rootfs.make_private(d, idmap.uid_base(1))
    st = d.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, idmap.uid_base(1), 0o710)
    rootfs.make_private(d, 0)
    assert (d.stat().st_gid, d.stat().st_mode & 0o777) == (0, 0o700)
