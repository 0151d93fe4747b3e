"""The overcommit line of ``sbx doctor`` (issue 36): what the sparse sandbox disks may grow to against the volume."""

from __future__ import annotations

import os
from pathlib import Path

from sbx.node.host.setup import overcommit, promised_disk_bytes
from tests.fakes import fake_settings

GiB = 1 << 30


def test_promised_bytes_are_the_apparent_sizes_of_every_nodes_disks(tmp_path: Path) -> None:
    settings = fake_settings(tmp_path)
    assert promised_disk_bytes(settings) == 0
    for node, sid, size in (("n1", "a", 20), ("n1", "b", 56), ("n2", "c", 20)):
        folder = settings.volume / "nodes" / node / "sandboxes" / sid
        folder.mkdir(parents=True)
        with open(folder / "disk.ext4", "wb") as f:
            f.truncate(size * GiB)  # sparse: takes nothing
    (settings.volume / "nodes" / "n1" / "sandboxes" / "a" / "memory").mkdir()  # not a disk
    assert promised_disk_bytes(settings) == 96 * GiB
    line = overcommit(settings, 80 * GiB)
    room = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert line.startswith("sandbox disks may grow to 96 GiB: 1.20x the 80 GiB volume, ")
    assert line.endswith(f"{96 * GiB / room:.2f}x the {room / GiB:.0f} GiB of room left")
    assert "-" in overcommit(settings, 0)  # no ratio against an unknown size
