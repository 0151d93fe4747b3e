"""Named and automatic snapshots of a sandbox's disk (:class:`SnapshotOps`)."""

from __future__ import annotations

import logging
import re
import secrets
from typing import Any

from sbx.control.errors import ControlError, from_node, not_found
from sbx.control.sandboxes.planebase import PlaneBase
from sbx.control.sandboxes.views import snapshot_view
from sbx.control.store.database import SnapshotRow, utcnow
from sbx.node.types import NodeError

log = logging.getLogger("sbx.control")

SNAPSHOT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class SnapshotOps(PlaneBase):
    """snapshot, snapshots, snapshot_views, delete_snapshot."""

    def snapshot(self, sandbox_id: str, name: str, auto: bool = False, wait: float | None = None) -> SnapshotRow:
        """Seal a named copy of the sandbox's disk (running or stopped). Raises 400 ``invalid_snapshot_name``
        (blank, over 63 characters, or characters outside ``A-Z a-z 0-9 . _ -``), 404, 409 ``snapshot_exists``/
        ``snapshots_disabled``/``busy``/``invalid_state``, 403 ``plan_limit`` when the account already holds its
        plan's included storage (stopped sandboxes and snapshots)."""
        if not SNAPSHOT_NAME_RE.match(name or ""):
            raise ControlError(
                "invalid_snapshot_name",
                "snapshot names are 1-63 characters: letters, digits, '.', '_' or '-', starting with a letter or digit",
                400,
            )
        row = self.get(sandbox_id)
        if row.no_snapshots:
            raise ControlError(
                "snapshots_disabled", f"sandbox {sandbox_id} was created with --no-snapshots", 409
            )
        if not auto:
            self._storage_admit(row.account_id, f"snapshot {name}")
        with self.lifecycle.hold(sandbox_id, {"running", "stopped"}, wait, "snapshot it"), self._snap_lock:
            if self.store.find_snapshot(name, row.account_id) is not None:
                raise ControlError("snapshot_exists", f"a snapshot named {name!r} already exists", 409)
            key = self._snapshot_key(name)
            try:
                info = self.node.snapshot(sandbox_id, key)
            except NodeError as e:
                raise from_node(e.code, e.message) from None
            snap = SnapshotRow(name=key, label=name, sandbox_id=sandbox_id, auto=auto, size_mib=info.size_mib,
                               created_at=utcnow(), account_id=row.account_id)
            return self.store.add_snapshot(snap, self.meter.snapshot_added(snap, info.allocated_bytes))

    def _snapshot_key(self, label: str) -> str:
        """The installation-wide key for a new snapshot labelled ``label`` (caller holds ``_snap_lock``): the label
        when no snapshot holds that key, else the label's first 50 characters and a random suffix (another
        account's snapshot of that name must neither block nor reveal itself)."""
        key = label
        while self.store.get_snapshot(key) is not None:
            key = f"{label[:50]}-{secrets.token_hex(4)}"
        return key

    def snapshots(self, sandbox_id: str | None = None, account_id: str | None = None) -> list[SnapshotRow]:
        """Snapshots, oldest first, optionally only those of ``sandbox_id`` (404 if that sandbox is unknown, or
        not ``account_id``'s) and of ``account_id``."""
        if sandbox_id is not None:
            sb = self.store.get_sandbox(sandbox_id)
            if sb is None or (account_id is not None and sb.account_id != account_id):
                raise not_found(f"sandbox {sandbox_id}")
        return self.store.list_snapshots(sandbox_id, account_id=account_id)

    def snapshot_views(self, rows: list[SnapshotRow]) -> list[dict[str, Any]]:
        """API views of ``rows`` (see :func:`snapshot_view`) with the node's current space figures for each."""
        try:
            infos = {i.name: i for i in self.node.snapshots()}
        except NodeError as e:
            log.warning("snapshot space figures unavailable: %s", e)
            infos = {}
        return [snapshot_view(r, infos.get(r.name)) for r in rows]

    def find_snapshot(self, label: str, account_id: str, admin: bool = False) -> SnapshotRow:
        """Account ``account_id``'s snapshot named ``label`` (the admin key: its own account's, else the oldest of
        that name in any account). Raises 404 ``not_found``, the same for another account's snapshot."""
        snap = self.store.find_snapshot(label, account_id, any_account=admin)
        if snap is None:
            raise not_found(f"snapshot {label}")
        return snap

    def delete_snapshot(self, name: str) -> None:
        """Remove the snapshot whose key is ``name`` (:class:`SnapshotRow`; :meth:`find_snapshot` turns an
        account's name into it); 404 ``not_found`` if there is none."""
        with self._snap_lock:
            if self.store.get_snapshot(name) is None:
                raise not_found(f"snapshot {name}")
            try:
                self.node.delete_snapshot(name)
            except NodeError as e:
                if e.code != "not_found":
                    raise from_node(e.code, e.message) from None
            self.store.delete_snapshot(name, self.meter.snapshot_removed(name))
        self.trimmer.request()

