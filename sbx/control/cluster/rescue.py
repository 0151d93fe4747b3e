"""Running sandboxes in the seal store (issue 34): a running sandbox's newest automatic snapshot uploaded to the seal
store (:mod:`sbx.control.cluster.archive`), and a running sandbox whose node is lost brought back on another node
from its newest stored seal, so a lost node loses at most the automatic snapshot interval
(``settings.auto_snapshot_seconds``) plus an upload. Both run in the seal store's loop
(:class:`sbx.control.cluster.archive.Archiver`), only with ``settings.seal_store``.

- **Uploaded**: each running sandbox (not ``noSnapshots``) whose newest automatic snapshot
  (:mod:`sbx.control.reaper`) is newer than its stored seal, on a node that answers: the node exports the snapshot's
  disk as a delta against its base image (``export_snapshot``, export kind ``snapshot``; no memory) and the files go
  up as a stopped sandbox's do. **Recorded** under the same rule: only once every file is in the store, and only if
  the sandbox still exists and the snapshot is still newer than its stored seal (a row lock); the row replaces the
  older seal (a stop's or a snapshot's), whose objects no other row names are deleted. Its ``sealed_at`` is the
  snapshot's ``created_at``; its manifest names the snapshot (``snapshot``, ``snapshotLabel``).
- **Lost**: a node this loop has seen unreachable for ``settings.seal_store_lost_seconds`` (counted from when this
  loop first saw it so, never from an old heartbeat: a replica that just took the lead waits the whole time), or no
  longer registered. Each running sandbox there with a stored seal (the newest: a stop's or a snapshot's) is
  restored from the store onto the ready node with the most room that fits its size (its disk only: a stop's memory
  image is not used, the processes it held are older than the disk the sandbox ran on since), the row turns
  ``stopped`` on that node (``stop_reason`` ``node_lost``; ``running -> stopping -> stopped``, its running interval
  ends then), the event ``recovered`` says from which seal and how old it was, and a resume boots it from that disk.
  The copy on the lost node is a leftover (:mod:`sbx.control.cluster.replicas` deletes it, killing it if it still
  runs, once that node answers again). A restore that fails changes nothing and is tried again next pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from sbx.control.cluster import placement
from sbx.control.errors import ControlError
from sbx.control.store.database import SandboxRow, SnapshotRow, as_utc, iso, utcnow
from sbx.node.types import NodeError
from sbx.storage.errors import StorageError

log = logging.getLogger("sbx.sealstore")


def snapshot_todo(rows: Iterable[SandboxRow], stored: dict[str, Any], newest: dict[str, SnapshotRow],
                  answering: set[str], default: str) -> list[tuple[SandboxRow, SnapshotRow]]:
    """The running sandboxes of ``rows`` whose newest automatic snapshot (``newest[id]``) is newer than their stored
    seal (``stored[id].sealed_at``, none counts as older), on a node of ``answering`` (``default`` when the row names
    none), each with that snapshot; not ``no_snapshots`` ones."""
    out = []
    for r in rows:
        snap = newest.get(r.id)
        if r.state != "running" or r.no_snapshots or snap is None or (r.node or default) not in answering:
            continue
        have = stored.get(r.id)
        if have is None or as_utc(have.sealed_at) < as_utc(snap.created_at):
            out.append((r, snap))
    return out


class LostNodes:
    """Which nodes count as lost: seen unreachable by this loop for ``after`` seconds (module docstring)."""

    def __init__(self, after: float):
        self.after = after
        self.since: dict[str, float] = {}

    def update(self, statuses: dict[str, str], now: float | None = None) -> None:
        """Note each node's status (``{name: ready|cordoned|unreachable}``) at ``now`` (monotonic seconds)."""
        now = time.monotonic() if now is None else now
        for name, status in statuses.items():
            if status == "unreachable":
                self.since.setdefault(name, now)
            else:
                self.since.pop(name, None)
        for name in set(self.since) - set(statuses):  # removed from the registry: lost at once
            self.since[name] = now - self.after

    def lost(self, name: str, registered: bool, now: float | None = None) -> bool:
        """True when node ``name`` is lost: not ``registered``, or unreachable for ``after`` seconds."""
        now = time.monotonic() if now is None else now
        if not registered:
            return True
        since = self.since.get(name)
        return since is not None and now - since >= self.after


def lost_todo(rows: Iterable[SandboxRow], stored: dict[str, Any], lost: LostNodes, registered: set[str],
              default: str, now: float | None = None) -> list[SandboxRow]:
    """The running sandboxes of ``rows`` with a stored seal whose node is lost."""
    return [r for r in rows if r.state == "running" and r.id in stored
            and lost.lost(r.node or default, (r.node or default) in registered, now)]


def seal_age(sealed_at: Any, now: Any = None) -> float:
    """Seconds from ``sealed_at`` (a datetime) to ``now`` (default: now)."""
    return ((now or utcnow()) - as_utc(sealed_at)).total_seconds()


class Rescue:
    """Snapshot uploads and the recovery of sandboxes of lost nodes for the loop of control plane ``cp`` (an
    :class:`sbx.control.service.ControlPlane` with a seal store: ``cp.archive``)."""

    def __init__(self, cp: Any):
        self.cp = cp
        self.lost = LostNodes(cp.settings.seal_store_lost_seconds)

    def upload(self, row: SandboxRow, snap: SnapshotRow, out: dict[str, Any]) -> None:
        """Upload snapshot ``snap`` of running ``row`` and record it (module docstring); ``out["snapshots"]`` gets
        ``{"id", "snapshot", "node", "bytes", "sent", "seconds"}``, ``out["failed"]`` ``{"id", "error"}``,
        ``out["freed"]`` the objects freed."""
        arch, t0 = self.cp.archive, time.monotonic()
        node = row.node or self.cp.router.default_name
        try:
            manifest, objects, sent = arch.upload_snapshot(self.cp.router.agent(node), row, snap.name)
        except (NodeError, StorageError) as e:
            log.warning("storing snapshot %s of %s failed (tried again next pass): %s", snap.name, row.id, e)
            out["failed"].append({"id": row.id, "error": e.code})
            return
        manifest["snapshotLabel"] = snap.label
        replaced = arch.record_snapshot(row, snap.created_at, manifest, objects)
        if replaced is None:  # the sandbox went, or a newer seal is stored: this one is not needed
            out["freed"] += arch.free(row.account_id, list(objects.values()))
            return
        out["freed"] += arch.free(row.account_id, replaced)
        size = sum(int(f["size"]) for f in manifest["files"].values())
        took = time.monotonic() - t0
        log.info("stored snapshot %s of running %s from %s: %d bytes (%d sent) in %.2f s", snap.name, row.id, node,
                 size, sent, took)
        out["snapshots"].append({"id": row.id, "snapshot": snap.label, "node": node, "bytes": size, "sent": sent,
                                 "seconds": took})

    def recover(self, row: SandboxRow, out: dict[str, Any]) -> None:
        """Bring running ``row``, whose node is lost, back on another node from its stored seal (module docstring);
        ``out["recovered"]`` gets the ``recovered`` event's fields, ``out["failed"]`` ``{"id", "error"}``."""
        cp, arch = self.cp, self.cp.archive
        src = row.node or cp.router.default_name
        stored = arch.get(row.id)
        if stored is None:
            return
        what = f"bringing {row.id} back from the seal store"
        ready = [c for c in cp._candidates(exclude=row.id) if c.status == "ready" and c.name != src]
        fit, _ = placement.fits(ready, cp.settings, cp.settings.size(row.type), what)
        if not fit:
            log.warning("%s: no ready node has room (tried again next pass)", what)
            out["failed"].append({"id": row.id, "error": "insufficient_capacity"})
            return
        dst = max(fit, key=lambda c: c.left_mib(cp.settings)).name
        agent = cp.router.agent(dst)
        try:
            info = arch.restore(agent, stored, disk_only=True)
        except NodeError as e:
            log.warning("%s to %s failed (tried again next pass): %s", what, dst, e.message)
            out["failed"].append({"id": row.id, "error": e.code})
            return
        if not self._flip(row, src, dst):
            try:
                agent.delete(row.id)
            except NodeError as e:
                log.warning("dropping the copy of %s on %s: %s", row.id, dst, e.message)
            return
        cp.replicas.add_leftover(row.id, src)
        snapshot = stored.manifest.get("snapshotLabel") or stored.manifest.get("snapshot")
        event = {"event": "recovered", "id": row.id, "from": src, "to": dst, "reason": "node_lost",
                 "seal": "snapshot" if stored.manifest.get("snapshot") else "stop", "snapshot": snapshot,
                 "sealedAt": iso(stored.sealed_at), "sealAgeSeconds": round(seal_age(stored.sealed_at), 1),
                 "bytes": info["bytes"]}
        cp.add_event(row.id, event)
        log.info("%s: node %s lost; back on %s from its %s seal of %s (%.1f s old)", row.id, src, dst,
                 event["seal"], event["sealedAt"], event["sealAgeSeconds"])
        out["recovered"].append(event)
        try:
            cp.resume(row.id, wait=0)
        except ControlError as e:  # it stays stopped there; its owner resumes it
            log.warning("resuming %s on %s after its recovery: %s", row.id, dst, e.message)

    def _flip(self, row: SandboxRow, src: str, dst: str) -> bool:
        """``running`` on ``src`` -> ``stopped`` on ``dst``; False (nothing changed) when it is no longer running
        there."""
        def check(now: SandboxRow) -> ControlError | None:
            if now.state != "running" or (now.node or self.cp.router.default_name) != src:
                return ControlError("invalid_state", f"sandbox {row.id} is no longer running on {src}", 409)
            return None

        try:
            self.cp.lifecycle.begin(row.id, "stopping", check, 0)
        except ControlError as e:
            log.info("not bringing %s back: %s", row.id, e.message)
            return False
        self.cp.lifecycle.transition(row.id, "stopped", node=dst, has_memory=False, memory_saved=False,
                                     stop_reason="node_lost", stop_error=None, memory_restored=None,
                                     resume_reason=None)
        return True
