"""Copies of a sandbox's disk: :class:`SnapshotMixin`.

Fork (a new sandbox booted from a reflink clone of a live disk) and named snapshots
(``<node_dir>/snapshots/<name>.ext4`` + ``.json``): take, list, delete. A live disk is frozen for the copy, with
a ``freezing`` intent in its record so a crash never leaves it frozen (:mod:`sbx.node.lifecycle.reconcile`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from sbx.node.agentbase import NodeBase, now
from sbx.node.steps import Steps
from sbx.node.types import NodeError, SandboxSpec, SnapshotInfo
from sbx.storage import disk as disks
from sbx.storage import space
from sbx.storage.errors import StorageError

_SNAPSHOT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class SnapshotMixin(NodeBase):
    """Fork and snapshots (part of :class:`sbx.node.agent.LocalNode`)."""

    def fork(self, source_id: str, spec: SandboxSpec, memory: bool = False) -> None:
        """See :meth:`sbx.node.types.NodeAgent.fork`; ``memory`` forks with memory
        (:meth:`sbx.node.memory.memcopy.MemoryCopyMixin.fork_memory`); not for a gvisor source (``not_supported``:
        runsc can't restore one memory image into a second sandbox here)."""
        if memory and self.runtime.gvisor(source_id):
            raise NodeError("not_supported", f"sandbox {source_id} is of the gvisor runtime class, which can't fork "
                                             "with memory; fork without memory (its disk) instead")
        if memory:
            self.fork_memory(source_id, spec)
            return
        self._record(source_id)  # raises not_found for an unknown source
        with self._lock(spec.id):
            self._new_record(spec, forkedFrom=source_id)
            self._clone_grown(source_id, spec)
            self._set_phase(spec.id, "stopped")
            self._boot(spec.id, spec.size, fresh_identity=True)

    def fork_stopped(self, source_id: str, spec: SandboxSpec, memory: bool = False) -> None:
        """Make ``spec`` a fork of ``source_id`` that does not start here: a stopped sandbox to move to another node
        (:mod:`sbx.control.sandboxes.forking`). Its disk is a reflink copy of the source's (frozen for the copy when it
        runs) grown to ``spec.size``: phase ``stopped``. With ``memory`` the running source pauses for the copy and a
        ``--leave-running`` dump as for :meth:`fork` with memory, and the dump becomes the fork's own image
        (:meth:`sbx.node.memory.memcopy.MemoryCopyMixin._seal_fork_memory`): phase ``checkpointed``. The record holds
        ``freshIdentity``: its first start, on whatever node, writes its new identity into the disk (a cold boot as
        :meth:`fork`'s; a memory restore also restarts the guest's identity service and sshd, as a fork with memory
        does). The source is not otherwise touched.

        Raises ``NodeError``: ``not_found``, ``not_running`` (``memory`` and the source does not run),
        ``fork_failed``, ``not_supported`` (``memory`` of a gvisor source); nothing of the fork is left then."""
        self._record(source_id)  # raises not_found for an unknown source
        if memory and self.runtime.gvisor(source_id):
            raise NodeError("not_supported", f"sandbox {source_id} is of the gvisor runtime class, which can't fork "
                                             "with memory; fork without memory (its disk) instead")
        st = Steps("fork-stopped", spec.id)
        with self._lock(spec.id):
            self._new_record(spec, forkedFrom=source_id, freshIdentity=True)
            try:
                if memory:
                    old_base = self._copy_running(source_id, spec, st)
                    self._seal_fork_memory(spec.id, old_base)
                else:
                    self._clone_grown(source_id, spec)
                    self._set_phase(spec.id, "stopped")
                st.mark("sealed")
            except BaseException:
                self.delete(spec.id)
                raise
        st.done()

    def _clone_grown(self, source_id: str, spec: SandboxSpec) -> None:
        """Reflink the source's disk into the new record of ``spec`` (both locks taken here) and grow it to
        ``spec.size``. Raises ``NodeError("fork_failed")``."""
        with self._lock(source_id):
            try:
                self._clone_live(source_id, self._disk(spec.id))
            except StorageError as e:
                raise NodeError("fork_failed", str(e)) from e
        if spec.size.disk_mib > self._disk_mib(spec.id):
            try:
                disks.grow(self._disk(spec.id), spec.size.disk_mib)
            except StorageError as e:
                raise NodeError("fork_failed", f"growing the fork's disk: {e}") from e

    def _clone_live(self, sid: str, dst: Path, fresh_uuid: bool = True, mode: int = 0o644,
                    mounted: bool = False) -> None:
        """Reflink-copy the sandbox's disk to ``dst`` (file mode ``mode``), freezing its filesystem for the copy
        when it is mounted (``mounted``: it must be, else ``not_mounted``); the copy gets a new ext4 UUID unless
        ``fresh_uuid`` is false (:func:`sbx.storage.disk.clone_disk`). A ``freezing`` intent (the mount point) is
        in the record while it may be frozen, so a reconcile after a crash in that window thaws it
        (:mod:`sbx.node.container.recovery`). Raises ``StorageError``."""
        mp = disks.mounted_at(self._disk(sid))
        if mp is None and mounted:
            raise StorageError("not_mounted", f"the disk of {sid} is not mounted")
        if mp is not None:
            rec = self._record(sid)
            rec["freezing"] = str(mp)
            self._save(sid, rec)
        try:
            disks.clone_disk(self._disk(sid), dst, mountpoint=mp, fresh_uuid=fresh_uuid, mode=mode)
        finally:
            if mp is not None:
                rec = self._record(sid)
                rec.pop("freezing", None)
                self._save(sid, rec)

    def _disk_mib(self, sid: str) -> int:
        return self._disk(sid).stat().st_size // (1024 * 1024)

    def _snapshot_path(self, name: str) -> Path:
        if not _SNAPSHOT_RE.match(name):
            raise NodeError("invalid_snapshot_name", f"bad snapshot name {name!r}")
        return self.snapshots_dir / f"{name}.ext4"

    def snapshot(self, id: str, name: str) -> SnapshotInfo:
        path = self._snapshot_path(name)
        if path.exists():
            raise NodeError("snapshot_exists", f"snapshot {name!r} already exists")
        with self._lock(id):
            self._record(id)
            tmp = path.with_suffix(".tmp")
            try:
                self._clone_live(id, tmp)
            except StorageError as e:
                raise NodeError("snapshot_failed", str(e)) from e
            os.chmod(tmp, 0o444)
            meta = {"name": name, "sourceId": id, "createdAt": now()}
            path.with_suffix(".json").write_text(json.dumps(meta))
            os.replace(tmp, path)
        return self._snapshot_info(name)

    def _snapshot_info(self, name: str) -> SnapshotInfo:
        path = self.snapshots_dir / f"{name}.ext4"
        meta = json.loads(path.with_suffix(".json").read_text())
        return SnapshotInfo(
            name=name,
            source_id=meta["sourceId"],
            size_mib=path.stat().st_size >> 20,
            allocated_bytes=space.allocated_bytes(path),
            unique_bytes=space.unique_bytes(
                path, self._all_images(exclude=path) + list(self.settings.images_dir.glob("*.ext4"))
            ),
        )

    def _all_images(self, exclude: Path) -> list[Path]:
        paths = list(self.sandboxes_dir.glob("*/disk.ext4")) + list(self.snapshots_dir.glob("*.ext4"))
        paths += list(self.sandboxes_dir.glob("*/seals/*.ext4"))
        return [p for p in paths if p != exclude]

    def snapshots(self) -> list[SnapshotInfo]:
        return [self._snapshot_info(p.stem) for p in sorted(self.snapshots_dir.glob("*.ext4"))]

    def delete_snapshot(self, name: str) -> None:
        path = self._snapshot_path(name)
        if not path.exists():
            raise NodeError("not_found", f"snapshot {name!r} does not exist")
        path.unlink()
        path.with_suffix(".json").unlink(missing_ok=True)
