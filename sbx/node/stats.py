"""What a sandbox is and uses: :class:`StatsMixin`.

Its status (running, checkpointed, stopped, absent) and resource samples: memory, CPU, in-sandbox disk use, OOM
kills (cgroup counters, :mod:`sbx.node.cgroup`) and the disk image's allocated and unique bytes on the volume
(FIEMAP, :mod:`sbx.storage.space`).
"""

from __future__ import annotations

import os
from pathlib import Path

from sbx.node import cgroup
from sbx.node.agentbase import NodeBase
from sbx.node.types import NodeStatus, Stats
from sbx.storage import space
from sbx.storage.errors import StorageError


class StatsMixin(NodeBase):
    """Status and stats (part of :class:`sbx.node.agent.LocalNode`)."""

    def status(self, id: str) -> NodeStatus:
        if not (self._dir(id) / "node.json").is_file():
            return "absent"
        if self.runtime.state(id) == "running":
            return "running"
        return "checkpointed" if self._memory_usable(id) else "stopped"

    def _disk_space(self, sid: str) -> tuple[int, int]:
        """``(allocated, unique)`` bytes of the sandbox's disk image on the volume: what the image maps (shared
        blocks included), and how much of that no other image maps — other sandboxes' disks and seals, named
        snapshots, and the cached base images in ``settings.images_dir`` — i.e. what deleting the sandbox gives
        back. The sandbox's own seals are not counted as sharers (they go with it); blocks only its seals still
        hold are not included. ``(0, 0)`` when the disk is missing. From FIEMAP (:mod:`sbx.storage.space`)."""
        disk = self._disk(sid)
        own = self._dir(sid) / "seals"
        others = [p for p in self._all_images(exclude=disk) if p.parent != own]
        others += list(self.settings.images_dir.glob("*.ext4"))
        try:
            return space.allocated_bytes(disk), space.unique_bytes(disk, others)
        except (StorageError, OSError):
            return 0, 0

    def stats(self, id: str, space: bool = True) -> Stats:
        """A fresh sample: memory, CPU and in-sandbox disk use while running (zeros otherwise), OOM kills, and
        the disk image's allocated and unique bytes on the volume (running or not, see :meth:`_disk_space`; with
        ``space=False`` unique bytes are 0 and no other image is read). CPU percent is measured since this node's
        previous sample of the sandbox (a 0.1 s window the first time).
        Raises ``NodeError("not_found")`` for a sandbox this node does not have."""
        rec = self._record(id)
        if space:
            alloc, unique = self._disk_space(id)
        else:
            disk = self._disk(id)
            alloc, unique = (_allocated(disk), 0)
        ooms = rec.get("oomKills", 0) + rec.get("oomKillsNested", 0) + self._nested_ooms.get(id, 0)
        if self.runtime.state(id) != "running":
            return Stats(0, 0, 0.0, 0, ooms, alloc, unique)
        s = cgroup.sample(self._cgroup_path(id), previous=self._cpu_samples.get(id))
        self._cpu_samples[id] = s.cpu_mark
        st = os.statvfs(self._rootfs(id))
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return Stats(
            memory_total_mb=s.memory_limit >> 20,
            memory_used_mb=s.memory_used >> 20,
            cpu_percent=s.cpu_percent,
            disk_used_mb=used >> 20,
            oom_kills=ooms + s.oom_kills,
            disk_allocated_bytes=alloc,
            disk_unique_bytes=unique,
        )


def _allocated(disk: Path) -> int:
    """Bytes the image maps on the volume (0 when it is missing)."""
    try:
        return space.allocated_bytes(disk)
    except (StorageError, OSError):
        return 0
