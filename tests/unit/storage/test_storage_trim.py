"""Space goes back to the host (issue 17): sandbox disks are mounted with ``discard`` so deleted data leaves the
image file, and :func:`sbx.storage.volume.trim_volume` shrinks the volume's sparse backing file once enough of it is
free. Runs on a throwaway 4 GiB volume of its own under /tmp (root needed), not the session's storage volume."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx.config import Settings
from sbx.storage import disk, mounts, volume

MiB = 1024 * 1024
GiB = 1024 * MiB


def _du(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def _slack_over(settings: Settings, floor: int, timeout: float = 60.0) -> int | None:
    """The volume's slack (:func:`volume.slack_bytes`) once it passes ``floor`` bytes, polled for at most ``timeout``
    seconds with a ``sync -f`` each time (XFS frees a deleted file's blocks in the background); the last value
    otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        subprocess.run(["sync", "-f", str(settings.volume)], check=True)
        slack = volume.slack_bytes(settings)
        if (slack is not None and slack > floor) or time.monotonic() > deadline:
            return slack
        time.sleep(0.5)


def _du_under(img: Path, mp: Path, ceiling: int, timeout: float = 60.0) -> int:
    """The image's allocated bytes once they fall under ``ceiling``, polled for at most ``timeout`` seconds with a
    ``sync -f`` of its mount each time; the last value otherwise. Since Linux 6.0 ext4 issues a commit's discards from
    a workqueue (``s_discard_work``), after the ``sync`` that committed the delete has returned, so the holes come a
    moment later on a busy host."""
    deadline = time.monotonic() + timeout
    while True:
        os.sync()
        subprocess.run(["sync", "-f", str(mp)], check=True)
        used = _du(img)
        if used < ceiling or time.monotonic() > deadline:
            return used
        time.sleep(0.5)


def _fill(path: Path, size: int) -> None:
    """Write ``size`` bytes of zeros (real blocks: nothing below detects zeros) and flush them to the host."""
    with path.open("wb") as f:
        chunk = bytes(4 * MiB)
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    assert os.geteuid() == 0, "needs root: loop devices and mounts"
    home = Path(f"/tmp/sbx-trimtest-{uuid.uuid4().hex[:8]}")
    settings = Settings(home=home, volume_size_gib=4, node_name="trimtest", state_dir=home / "server")
    volume.ensure_volume(settings)
    try:
        yield settings
    finally:
        for m in sorted(mounts.mounts(), key=lambda m: len(str(m.mountpoint)), reverse=True):
            if str(m.mountpoint).startswith(str(home) + "/") and m.mountpoint != settings.volume:
                disk.umount(m.mountpoint)
        volume.unmount_volume(settings, remove_backing=True)
        shutil.rmtree(home, ignore_errors=True)


def test_a_read_write_disk_mount_discards_so_deleted_data_leaves_the_image(own: Settings) -> None:
    img = own.node_dir / "disk.ext4"
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img), "1G"], check=True, capture_output=True)
    mp = own.home / "mnt" / "disk"
    disk.mount(img, mp)
    try:
        opts = [line.split()[3] for line in Path("/proc/self/mounts").read_text().splitlines()
                if line.split()[1] == str(mp.resolve())]
        assert opts and "discard" in opts[-1].split(","), opts
        before = _du(img)
        _fill(mp / "big", 400 * MiB)
        assert _du(img) > before + 350 * MiB
        (mp / "big").unlink()
        assert _du_under(img, mp, before + 50 * MiB) < before + 50 * MiB  # discarded: holes in the image again
    finally:
        disk.umount(mp)
        img.unlink()


def test_trim_gives_a_gib_of_freed_volume_space_back_and_skips_small_slack(own: Settings) -> None:
    backing = own.volume_backing
    small = own.volume / "small.bin"
    _fill(small, 200 * MiB)
    small.unlink()
    os.sync()
    grown = _du(backing)
    assert volume.trim_volume(own, min_slack=volume.TRIM_SLACK_BYTES) is None  # under the threshold asked for
    assert _du(backing) >= grown - 50 * MiB

    big = own.volume / "big.bin"
    start = _du(backing)
    _fill(big, 1536 * MiB)
    assert _du(backing) > start + 1200 * MiB  # (the 200 MiB freed before are written again first)
    big.unlink()
    os.sync()
    slack = _slack_over(own, GiB)
    assert slack is not None and slack > GiB
    assert volume.trim_volume(own) is not None
    assert _du(backing) < start + 100 * MiB
