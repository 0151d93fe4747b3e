"""What a sandbox is and uses: :class:`StatsMixin`.

Its status (running, checkpointed, stopped, absent) and resource samples: memory, CPU, in-sandbox disk use, OOM
kills (cgroup counters, :mod:`sbx.node.container.cgroup`) and the disk image's allocated and unique bytes on the volume
(FIEMAP, :mod:`sbx.storage.space`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sbx.node.agentbase import NodeBase
from sbx.node.container import cgroup
from sbx.node.types import NodeInfo, NodeStatus, Stats
from sbx.runtime import criu
from sbx.storage import space
from sbx.storage.errors import StorageError
from sbx.storage.volume import free_space


class StatsMixin(NodeBase):
    """Status and stats (part of :class:`sbx.node.agent.LocalNode`)."""

    def status(self, id: str, settled: bool = False) -> NodeStatus:
        """See :meth:`sbx.node.types.NodeAgent.status` (``settled`` waits for the sandbox's lock, so for an
        operation in flight to end). ``absent`` also for a sandbox still arriving from another node (not confirmed:
        it is its source's) and for the paused copy a migration left here once the destination confirmed (it runs
        there; the copy is being deleted: ``MigrationMixin._depart``); ``running`` also while the container is
        paused (frozen for a fork's or a migration's dump: its processes are all there)."""
        if settled:
            with self._lock(id):
                return self._status(id)
        return self._status(id)

    def _status(self, id: str) -> NodeStatus:
        try:
            phase = json.loads((self._dir(id) / "node.json").read_text()).get("phase")
        except (OSError, ValueError):
            return "absent"
        if phase == "incoming" or id in self._departing:
            return "absent"
        if self.runtime.state(id) in ("running", "paused"):
            return "running"
        return "checkpointed" if self._memory_usable(id) else "stopped"

    def info(self) -> NodeInfo:
        """This host's heartbeat: RAM from ``/proc/meminfo``, room from :func:`sbx.storage.volume.free_space`, online
        CPUs, the 1-minute load, running containers and the CRIU fingerprint (measured once per process: the CPU,
        kernel and CRIU of a running host do not change)."""
        if self._fingerprint is None:
            self._fingerprint = criu.host_fingerprint(str(self.runtime.criu))
        memory = 0
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) // 1024
        room = free_space(self.settings)
        running = sum(1 for status in self.runtime.statuses().values() if status == "running")
        return NodeInfo(name=self.settings.node_name, memory_mib=memory, disk_free_bytes=room.free_bytes,
                        disk_path=room.path, vcpus=os.cpu_count() or 1, load1=round(os.getloadavg()[0], 2),
                        running=running, fingerprint=dict(self._fingerprint),
                        egress=self.egress_ready())

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
        if not self._is_running(id):
            return Stats(0, 0, 0.0, 0, ooms, alloc, unique, _tree_bytes(self._memory(id)) if space else 0)
        s = cgroup.sample(self._cgroup_path(id), previous=self._cpu_samples.get(id),
                          last_percent=self._cpu_percent.get(id))
        self._cpu_samples[id], self._cpu_percent[id] = s.cpu_mark, s.cpu_percent
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


def _tree_bytes(folder: Path) -> int:
    """Bytes the files under ``folder`` occupy (``st_blocks`` x 512; 0 when it is missing): a memory image."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


def _allocated(disk: Path) -> int:
    """Bytes the image maps on the volume (0 when it is missing)."""
    try:
        return space.allocated_bytes(disk)
    except (StorageError, OSError):
        return 0
