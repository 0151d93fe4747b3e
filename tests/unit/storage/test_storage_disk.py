"""Sparse ext4 disks: create, grow, mount, freeze, fork (clone_disk) and seal chains."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from storage_helpers import MiB, sha256, write_random

from sbx.storage import disk, mounts, space
from sbx.storage import seals as seals_mod
from sbx.storage.errors import StorageError


def blkid_uuid(path: Path) -> str:
    out = subprocess.run(["blkid", "-p", "-o", "value", "-s", "UUID", str(path)], capture_output=True, text=True)
    return out.stdout.strip()


def fsck_clean(path: Path) -> bool:
    return subprocess.run(["e2fsck", "-fn", str(path)], capture_output=True).returncode == 0


def test_create_disk_grows_and_gets_a_new_uuid(work: Path, base_image: Path, mnt: Callable[[str], Path]) -> None:
    d = disk.create_disk(base_image, work / "d.ext4", 1024)
    info, base = disk.fs_info(d), disk.fs_info(base_image)
    assert d.stat().st_size == 1024 * MiB
    assert info["size_bytes"] == 1024 * MiB  # resize2fs filled the file
    assert info["uuid"] != base["uuid"]
    assert blkid_uuid(d) == info["uuid"]
    assert blkid_uuid(base_image) == base["uuid"]  # the base is untouched
    assert "metadata_csum_seed" in info["features"]
    assert d.stat().st_blocks * 512 < 128 * MiB  # still sparse
    assert fsck_clean(d)
    m = mnt("create")
    disk.mount(d, m)
    assert (m / "etc" / "hostname").read_text() == "base\n"
    assert os.statvfs(m).f_blocks * os.statvfs(m).f_frsize > 900 * MiB


def test_create_disk_rejects_bad_sizes(work: Path, base_image: Path) -> None:
    for bad in (32, 0, -5, 1.5, "100"):
        with pytest.raises(StorageError) as e:
            disk.create_disk(base_image, work / "x.ext4", bad)  # type: ignore[arg-type]
        assert e.value.code == "invalid_resize"
        assert not (work / "x.ext4").exists()
    with pytest.raises(StorageError) as e:
        disk.create_disk(work / "no-base.ext4", work / "x.ext4", 100)
    assert e.value.code == "not_found"


def test_grow_refuses_to_shrink_and_grows_unmounted(work: Path, base_image: Path) -> None:
    d = disk.create_disk(base_image, work / "d.ext4", 512)
    with pytest.raises(StorageError) as e:
        disk.grow(d, 256)
    assert e.value.code == "invalid_resize"
    assert d.stat().st_size == 512 * MiB and disk.fs_info(d)["size_bytes"] == 512 * MiB
    disk.grow(d, 512)  # same size: no-op
    disk.grow(d, 2048)
    assert d.stat().st_size == 2048 * MiB
    assert disk.fs_info(d)["size_bytes"] == 2048 * MiB
    assert fsck_clean(d)


def test_grow_refuses_a_mounted_disk(work: Path, base_image: Path, mnt: Callable[[str], Path]) -> None:
    d = disk.create_disk(base_image, work / "d.ext4", 256)
    m = mnt("online")
    disk.mount(d, m)
    with pytest.raises(StorageError) as e:
        disk.grow(d, 1024)
    assert e.value.code == "busy"
    assert d.stat().st_size == 256 * MiB
    disk.umount(m)
    disk.grow(d, 1024)
    assert disk.fs_info(d)["size_bytes"] == 1024 * MiB
    assert fsck_clean(d)


def test_mount_and_umount_manage_the_loop_device(work: Path, base_image: Path, mnt: Callable[[str], Path]) -> None:
    d = disk.create_disk(base_image, work / "d.ext4", 128)
    m1, m2 = mnt("m1"), mnt("m2")
    dev = disk.mount(d, m1)
    assert dev.startswith("/dev/loop")
    assert disk.mounted_at(d) == m1
    assert mounts.loop_devices_for(d) == [dev]
    assert disk.mount(d, m1) == dev  # idempotent
    with pytest.raises(StorageError) as e:
        disk.mount(d, m2)  # one ext4 must never be mounted twice
    assert e.value.code == "busy"
    with pytest.raises(StorageError) as e:
        disk.remove_disk(d)
    assert e.value.code == "busy"
    disk.umount(m1)
    assert disk.mounted_at(d) is None
    assert mounts.loop_devices_for(d) == []  # detached
    disk.umount(m1)  # nothing mounted: no-op
    # a loop device left bound without a mount (as after a crash) is reused, never doubled
    left = subprocess.run(["losetup", "--find", "--show", str(d)], capture_output=True, text=True, check=True)
    assert disk.mount(d, m2) == left.stdout.strip()
    disk.detach(d)
    assert disk.mounted_at(d) is None and mounts.loop_devices_for(d) == []
    disk.remove_disk(d)
    assert not d.exists()


def test_frozen_always_thaws(work: Path, base_image: Path, mnt: Callable[[str], Path]) -> None:
    d = disk.create_disk(base_image, work / "d.ext4", 128)
    m = mnt("freeze")
    disk.mount(d, m)
    with pytest.raises(RuntimeError):
        with disk.frozen(m):
            raise RuntimeError("boom")
    # thawed: a second thaw is refused by the kernel, and a write goes through (in a child, so a bug can't
    # hang the test run)
    with pytest.raises(StorageError):
        disk.thaw(m)
    subprocess.run(["sh", "-c", f"echo ok > {m}/after && sync -f {m}/after"], check=True, timeout=30)
    with pytest.raises(StorageError) as e:
        disk.freeze(work / "not-a-mount")
    assert e.value.code == "not_mounted"


def test_clone_of_a_mounted_disk_holds_the_last_write(work: Path, base_image: Path, mnt: Callable[[str], Path]) -> None:
    src = disk.create_disk(base_image, work / "src.ext4", 512)
    m = mnt("src")
    disk.mount(src, m)
    src_uuid = disk.fs_info(src)["uuid"]
    payload = os.urandom(3 * MiB)
    with open(m / "last-write.bin", "wb") as f:  # written, not synced: still in the page cache
        f.write(payload)
    (m / "note.txt").write_text("written right before the fork\n")
    dst = disk.clone_disk(src, work / "fork.ext4")  # finds the mount itself and freezes it
    assert fsck_clean(dst)  # the copy is a clean filesystem
    assert disk.fs_info(dst)["uuid"] != src_uuid
    m2 = mnt("fork")
    disk.mount(dst, m2)
    assert (m2 / "note.txt").read_text() == "written right before the fork\n"
    assert (m2 / "last-write.bin").read_bytes() == payload
    # both keep running separately; the source was thawed and kept its UUID
    (m / "src-only").write_text("s")
    (m2 / "fork-only").write_text("f")
    assert not (m2 / "src-only").exists() and not (m / "fork-only").exists()
    disk.umount(m)
    assert disk.fs_info(src)["uuid"] == src_uuid


def test_clone_disk_with_explicit_mountpoint_must_be_mounted(work: Path, base_image: Path) -> None:
    src = disk.create_disk(base_image, work / "src.ext4", 128)
    with pytest.raises(StorageError) as e:
        disk.clone_disk(src, work / "dst.ext4", mountpoint=work / "nowhere")
    assert e.value.code == "not_mounted"
    assert not (work / "dst.ext4").exists()
    dst = disk.clone_disk(src, work / "dst.ext4")  # unmounted source: plain reflink + new UUID
    assert disk.fs_info(dst)["uuid"] != disk.fs_info(src)["uuid"]
    # only the superblocks differ: the fork shares everything else
    assert space.unique_bytes(dst, [src]) < MiB


def test_clone_disk_can_leave_the_new_uuid_for_later(work: Path, base_image: Path,
                                                    mnt: Callable[[str], Path]) -> None:
    """A fork with memory copies the frozen disk first and gives the copy its UUID beside CRIU's dump
    (sbx.node.memory.memcopy): ``fresh_uuid=False`` copies only, :func:`disk.new_uuid` later gives the copy its own."""
    src = disk.create_disk(base_image, work / "src.ext4", 128)
    m = mnt("src")
    disk.mount(src, m)
    (m / "note.txt").write_text("before the copy\n")
    src_uuid = disk.fs_info(src)["uuid"]
    dst = disk.clone_disk(src, work / "dst.ext4", fresh_uuid=False)
    disk.umount(m)
    assert fsck_clean(dst)
    assert disk.fs_info(dst)["uuid"] == src_uuid
    assert disk.new_uuid(dst) != src_uuid == disk.fs_info(src)["uuid"]
    m2 = mnt("dst")
    disk.mount(dst, m2)
    assert (m2 / "note.txt").read_text() == "before the copy\n"
    disk.umount(m2)


def test_seal_chain_and_manifest(work: Path, base_image: Path, mnt: Callable[[str], Path]) -> None:
    d = disk.create_disk(base_image, work / "d.ext4", 256)
    seals_dir = work / "seals"
    m = mnt("seal")
    disk.mount(d, m)
    (m / "gen").write_text("1")
    s1 = seals_mod.seal(d, seals_dir)  # mounted: frozen for the copy
    (m / "gen").write_text("2")
    s2 = seals_mod.seal(d, seals_dir)
    disk.umount(m)
    write_random(d, 4096, offset=200 * MiB)  # change a block of the unmounted image directly
    s3 = seals_mod.seal(d, seals_dir)

    assert [s.seq for s in (s1, s2, s3)] == [1, 2, 3]
    assert [s.parent for s in (s1, s2, s3)] == [None, 1, 2]
    assert s3.path == seals_dir / "3.ext4"
    assert s3.path.stat().st_mode & 0o777 == 0o444
    manifest = json.loads((seals_dir / "3.json").read_text())
    assert manifest["seq"] == 3 and manifest["parent"] == 2
    assert manifest["size_bytes"] == 256 * MiB and manifest["image"] == "3.ext4"
    assert manifest["created_at"].endswith("Z")
    assert sha256(s3.path) == sha256(d)
    assert disk.fs_info(s1.path)["uuid"] == disk.fs_info(d)["uuid"]  # a checkpoint keeps the identity
    assert fsck_clean(s1.path) and fsck_clean(s2.path)
    out = subprocess.run(["debugfs", "-R", "cat /gen", str(s1.path)], capture_output=True, text=True)
    assert out.stdout == "1"
    out = subprocess.run(["debugfs", "-R", "cat /gen", str(s2.path)], capture_output=True, text=True)
    assert out.stdout == "2"
    assert [s.seq for s in seals_mod.list_seals(seals_dir)] == [1, 2, 3]

    seals_mod.delete_seal(seals_dir, 2)
    assert [(s.seq, s.parent) for s in seals_mod.list_seals(seals_dir)] == [(1, None), (3, 1)]
    assert seals_mod.seal(d, seals_dir).seq == 4  # numbers are never reused
    with pytest.raises(StorageError) as e:
        seals_mod.get_seal(seals_dir, 2)
    assert e.value.code == "not_found"


def test_seal_ignores_an_image_without_manifest(work: Path, base_image: Path) -> None:
    d = disk.create_disk(base_image, work / "d.ext4", 128)
    seals_dir = work / "seals"
    seals_dir.mkdir()
    (seals_dir / "1.ext4").write_bytes(b"half-made")  # as a crash between image and manifest leaves it
    assert seals_mod.list_seals(seals_dir) == []
    s = seals_mod.seal(d, seals_dir)
    assert s.seq == 2 and s.parent is None
