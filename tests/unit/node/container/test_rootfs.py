"""The disk's two mounts (:func:`sbx.node.container.rootfs.mount_root` / :func:`~sbx.node.container.rootfs.umount_root`)
on a real small ext4 image: made, repaired after a crash left one of them, and taken down with the loop device; the
folder permissions of :func:`~sbx.node.container.rootfs.make_private`."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from sbx.node.container import rootfs
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


def test_an_unmount_waits_for_a_process_letting_go_of_the_disk(image: Path, tmp_path: Path) -> None:
    """A process that still holds a file on the disk (as a killed container's do for a moment) makes the unmount
    wait for it, and says who held it; with no time to wait the unmount is refused (busy) and nothing changes."""
    host, view = tmp_path / "b" / "disk", tmp_path / "b" / "rootfs"
    rootfs.mount_root(image, host, view, idmap.uid_base(9))
    (host / "held").write_text("x")
    holder = subprocess.Popen(["sh", "-c", "exec 3<held; sleep 0.8"], cwd=host)
    try:
        assert any(h.startswith(f"{holder.pid} (") for h in rootfs.holders_of(host))
        with pytest.raises(rootfs.StorageError) as e:
            rootfs.umount_root(image, view, busy_wait=0)
        assert e.value.code == "busy" and mounts.mount_at(host) is not None
        rootfs.umount_root(image, view)  # waits for the holder to exit
        assert holder.poll() == 0
    finally:
        holder.kill()
        holder.wait()
        rootfs.umount_root(image, view)
    assert mounts.mount_at(host) is None
    deadline = time.monotonic() + 10  # the loop device lets go lazily (seen in CI: still listed at once)
    while mounts.loop_devices_for(image) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mounts.loop_devices_for(image) == []
