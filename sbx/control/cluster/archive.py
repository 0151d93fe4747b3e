"""Seals in the seal store (issue 34): a stopped sandbox's disk delta and memory image uploaded to an S3 bucket (or a
directory), so it resumes on any node when its own node and any replica are gone: :class:`SealArchive` (the bucket
and the store's ``seal_archives`` rows) and :class:`Archiver` (the upload loop). Off unless ``settings.seal_store``
(``SBX_SEAL_STORE``) is set.

- **Uploaded** by a loop on the replica that leads the ``seal-store`` duty, every ``settings.seal_store_seconds``: each
  stopped sandbox (not ``noSnapshots``) whose current seal is not in the store, on a node that answers, is exported
  as for a seal replica (:mod:`sbx.node.migration.transfer`, ``kind="archive"``: its disk delta against the base
  image, and hard links to its memory image's files) and each file is put through :class:`SealObjects`
  (content-addressed by SHA-256 under the account, AES-256-GCM with the account's key, :data:`FILES_AT_ONCE` files
  at a time, large ones in parallel parts; a file already there is not sent again). Up to :data:`BATCH` per pass.
- **Recorded** only after every file is in the store, and only if the sandbox is still ``stopped`` with the
  ``updated_at`` it had when the export began (a row lock): the ``seal_archives`` row names each file's object.
  A failed upload (the store unreachable, killed mid-part) records nothing and is tried again next pass.
- **Used** by a resume whose node is unreachable (or gone from the registry) and whose replica can't take it
  (:meth:`sbx.control.sandboxes.moving.MoveOps._resume_place`): the destination receives the files as a seal replica
  (``begin_replica``/``replica_stream``/``seal_replica``, hash-checked as they land, after each object's own
  checks) and promotes it (``promote_replica``), with its memory image when its fingerprint matches the one the
  image was made on, else it boots from the disk.
- **Freed**: a row replaced by a newer seal, or of a sandbox deleted, goes; an object no row of its account names
  any more is deleted from the store (references counted over the rows, in the loop: the only writer). Each hour
  (and at the first pass) a sweep deletes objects no row names that are older than an hour: what an upload cut by
  a failure or a crash left.

Per-account keys derive from the server's master key (``<state_dir>/secrets.key``, the one of
:mod:`sbx.control.secrets.vault`) with HKDF (:func:`sbx.storage.objects.account_key`): nodes never hold them.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, String, delete, select
from sqlalchemy.orm import Mapped, mapped_column

from sbx.config import Settings
from sbx.control.cluster.relocate import clear_stale
from sbx.control.cluster.rescue import Rescue, lost_todo, snapshot_todo
from sbx.control.cluster.view import ClusterView
from sbx.control.secrets.vault import load_key
from sbx.control.store.database import Base, SandboxRow, Store, as_utc, utcnow
from sbx.control.store.locks import LeaderLoop
from sbx.node.types import NodeError
from sbx.storage.errors import StorageError
from sbx.storage.objects import SealObjects, account_key, open_store

log = logging.getLogger("sbx.sealstore")

BATCH = 4
"""Sandboxes uploaded per pass at most."""

FILES_AT_ONCE = 4
"""Files of one seal uploaded at the same time (each large one in parallel parts too)."""

SWEEP_AGE = 3600.0
"""Seconds an object no seal names stays in the store before a sweep deletes it (an upload under way names none)."""

SWEEP_EVERY = 3600.0
"""Seconds between two sweeps of the store (the first pass sweeps too)."""

SETTLE = 2.0
"""Seconds a sandbox stays stopped before its seal is uploaded (a resume right after a stop doesn't race it)."""


class ArchiveRow(Base):
    """The seal of stopped sandbox ``sandbox_id`` in the seal store: ``objects`` ``{file name: object name}``,
    ``manifest`` (the export's, :meth:`sbx.node.migration.transfer.TransferMixin.export_stopped`), ``bytes`` (sum of
    the files), ``memory``, ``fingerprint`` (of the node the memory image was made on), ``sealed_at`` (the sandbox's
    ``updated_at`` when the export began: the seal is current while they are equal), ``made_at``."""

    __tablename__ = "seal_archives"

    sandbox_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    account_id: Mapped[str] = mapped_column(String(24), index=True)
    objects: Mapped[dict[str, str]] = mapped_column(JSON)
    manifest: Mapped[dict[str, Any]] = mapped_column(JSON)
    bytes: Mapped[int] = mapped_column(BigInteger)
    memory: Mapped[bool] = mapped_column(Boolean)
    fingerprint: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    sealed_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    made_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


def is_current(arch: ArchiveRow, row: SandboxRow) -> bool:
    """True when stored seal ``arch`` is the seal of ``row``'s current stop (not a snapshot's, and ``row`` is
    ``stopped`` and unchanged since)."""
    return (row.state == "stopped" and as_utc(arch.sealed_at) == as_utc(row.updated_at)
            and "snapshot" not in arch.manifest)


class SealArchive:
    """The seal store of one control plane: the bucket (``objects``), the account keys and the rows (module
    docstring). Raises ``StorageError("bad_store")`` for a ``settings.seal_store`` it can't use."""

    def __init__(self, store: Store, settings: Settings):
        self.store = store
        self.settings = settings
        self.objects = SealObjects(open_store(settings.seal_store, settings.s3_endpoint, settings.s3_region,
                                              settings.s3_access_key, settings.s3_secret_key),
                                   settings.state_dir / "seal-spool")
        self._master: bytes | None = None
        self._lock = threading.Lock()

    def key(self, account_id: str) -> bytes:
        """The 32-byte seal key of ``account_id``."""
        with self._lock:
            if self._master is None:
                self._master = load_key(self.settings.state_dir / "secrets.key")
        return account_key(self._master, account_id)

    def check(self) -> None:
        """Prove the store answers and takes writes. Raises ``StorageError`` (``bucket_not_found``,
        ``bad_credentials``, ``store_unreachable``, ``store_failed``)."""
        self.objects.store.check()

    # rows --------------------------------------------------------------------------------------------------------
    def get(self, sandbox_id: str) -> ArchiveRow | None:
        with self.store.session() as s:
            return s.get(ArchiveRow, sandbox_id)

    def all(self) -> dict[str, ArchiveRow]:
        with self.store.session() as s:
            return {r.sandbox_id: r for r in s.scalars(select(ArchiveRow))}

    def current(self, row: SandboxRow) -> ArchiveRow | None:
        """The stored seal of ``row`` when it is the seal of its current stop (it is ``stopped`` and unchanged
        since), else None."""
        arch = self.get(row.id)
        return arch if arch is not None and is_current(arch, row) else None

    def record(self, row: SandboxRow, manifest: dict[str, Any], objects: dict[str, str]) -> bool:
        """Write ``row``'s seal row (replacing an older one), only if the sandbox is still ``stopped`` with the
        ``updated_at`` it had (the upload is of its current seal); True when written."""
        with self.store.session() as s, s.begin():
            now = s.scalars(select(SandboxRow).where(SandboxRow.id == row.id).with_for_update()).first()
            if now is None or now.state != "stopped" or as_utc(now.updated_at) != as_utc(row.updated_at):
                return False
            s.merge(ArchiveRow(sandbox_id=row.id, account_id=row.account_id, objects=objects, manifest=manifest,
                               bytes=sum(int(f["size"]) for f in manifest["files"].values()),
                               memory=bool(manifest["memory"]), fingerprint=manifest.get("fingerprint"),
                               sealed_at=row.updated_at, made_at=utcnow()))
        return True

    def record_snapshot(self, row: SandboxRow, sealed_at: dt.datetime, manifest: dict[str, Any],
                        objects: dict[str, str]) -> list[str] | None:
        """Write ``row``'s seal row for a snapshot taken at ``sealed_at`` (:mod:`sbx.control.cluster.rescue`), only if
        the sandbox still exists and its stored seal (if any) is older; returns the objects the replaced row named
        (``[]`` for none), None when nothing was written."""
        with self.store.session() as s, s.begin():
            now = s.scalars(select(SandboxRow).where(SandboxRow.id == row.id).with_for_update()).first()
            if now is None or now.state in ("deleting", "deleted"):
                return None
            old = s.get(ArchiveRow, row.id)
            if old is not None and as_utc(old.sealed_at) >= as_utc(sealed_at):
                return None
            replaced = list(old.objects.values()) if old is not None else []
            s.merge(ArchiveRow(sandbox_id=row.id, account_id=row.account_id, objects=objects, manifest=manifest,
                               bytes=sum(int(f["size"]) for f in manifest["files"].values()), memory=False,
                               fingerprint=None, sealed_at=sealed_at, made_at=utcnow()))
        return replaced

    def forget(self, sandbox_id: str) -> list[str]:
        """Remove the row of ``sandbox_id``; returns the objects it named."""
        with self.store.session() as s, s.begin():
            arch = s.get(ArchiveRow, sandbox_id)
            if arch is None:
                return []
            names = list(arch.objects.values())
            s.execute(delete(ArchiveRow).where(ArchiveRow.sandbox_id == sandbox_id))
        return names

    def free(self, account_id: str, names: list[str]) -> list[str]:
        """Delete from the store each of ``names`` (objects of ``account_id``) that no row names; returns those
        deleted. Raises ``StorageError``."""
        with self.store.session() as s:
            used = {n for r in s.scalars(select(ArchiveRow).where(ArchiveRow.account_id == account_id))
                    for n in r.objects.values()}
        gone = [n for n in dict.fromkeys(names) if n not in used]
        for n in gone:
            self.objects.store.delete(n)
        return gone

    def sweep(self, min_age: float = SWEEP_AGE) -> list[str]:
        """Delete every object of the store that no row names and that is older than ``min_age`` seconds (what an
        upload cut by a crash or a failure left), and spool files as old; returns the objects deleted. Raises
        ``StorageError``."""
        with self.store.session() as s:
            used = {n for r in s.scalars(select(ArchiveRow)) for n in r.objects.values()}
        now = time.time()
        spool = self.objects.spool
        for f in spool.iterdir() if spool.is_dir() else []:
            if now - f.stat().st_mtime >= min_age:
                f.unlink(missing_ok=True)
        gone = [n for n, mtime in self.objects.store.names() if n not in used and now - mtime >= min_age]
        for n in gone:
            self.objects.store.delete(n)
        return gone

    # upload and restore ------------------------------------------------------------------------------------------
    def upload(self, agent: Any, row: SandboxRow) -> tuple[dict[str, Any], dict[str, str], int]:
        """Export stopped sandbox ``row`` from node ``agent`` and put its files in the store. Returns ``(manifest,
        {file: object}, bytes sent)`` (files already stored are not sent). Raises ``NodeError`` or
        ``StorageError``; nothing is recorded."""
        return self._put(agent, row, agent.export_stopped(row.id, agent.transfer_parent(), kind="archive"),
                         "archive")

    def upload_snapshot(self, agent: Any, row: SandboxRow, snapshot: str) -> tuple[dict[str, Any], dict[str, str],
                                                                                    int]:
        """Export snapshot ``snapshot`` (its node key) of sandbox ``row`` from node ``agent`` (its disk only) and put
        it in the store; returns and raises as :meth:`upload`."""
        return self._put(agent, row, agent.export_snapshot(row.id, snapshot, agent.transfer_parent()), "snapshot")

    def _put(self, agent: Any, row: SandboxRow, manifest: dict[str, Any], kind: str
             ) -> tuple[dict[str, Any], dict[str, str], int]:
        key = self.key(row.account_id)

        def one(name: str) -> tuple[str, int]:
            return self.objects.put(key, row.account_id, agent.export_file(row.id, name, kind=kind),
                                    sha256=str(manifest["files"][name]["sha256"]))

        try:
            with ThreadPoolExecutor(FILES_AT_ONCE, thread_name_prefix="sbx-seal-put") as pool:
                done = dict(zip(manifest["files"], pool.map(one, manifest["files"]), strict=True))
        finally:
            try:
                agent.end_export(row.id, kind=kind)
            except NodeError as e:
                log.warning("cleaning up the seal export of %s: %s", row.id, e.message)
        return manifest, {n: obj for n, (obj, _) in done.items()}, sum(max(n, 0) for _, n in done.values())

    def restore(self, dst: Any, arch: ArchiveRow, disk_only: bool = False) -> dict[str, Any]:
        """Make the stored seal ``arch`` the stopped sandbox on node ``dst`` (through a seal replica there, module
        docstring); with ``disk_only`` without its memory image (it boots from the disk). Returns the shape of
        :func:`sbx.control.cluster.relocate.move_stopped`'s answer (``delta`` ``"seal-store"``). Raises
        ``NodeError`` (``transfer_failed`` when the store fails or an object's checks do; the destination keeps
        nothing then)."""
        t0 = time.monotonic()
        sid = arch.sandbox_id
        clear_stale(dst, sid)
        key = self.key(arch.account_id)
        manifest, objects = arch.manifest, arch.objects
        if disk_only:
            objects = {n: o for n, o in objects.items() if not n.startswith("memory/")}
            manifest = {**manifest, "memory": False, "fingerprint": None,
                        "files": {n: f for n, f in manifest["files"].items() if n in objects}}
        try:
            dst.begin_replica(manifest)
            for name, obj in objects.items():
                dst.replica_stream(sid, name, self.objects.get(key, obj))
            dst.seal_replica(sid)
            info = dst.promote_replica(sid)
        except StorageError as e:
            self._drop(dst, sid)
            raise NodeError("transfer_failed", f"reading the seal of {sid} from the seal store: {e}") from e
        except BaseException:
            self._drop(dst, sid)
            raise
        return {**info, "delta": "seal-store", "seconds": time.monotonic() - t0}

    @staticmethod
    def _drop(dst: Any, sid: str) -> None:
        try:
            dst.drop_replica(sid)
        except NodeError as e:
            log.warning("dropping the unfinished copy of %s from the seal store: %s", sid, e.message)


class ArchivedPlane(ClusterView, Protocol):
    """What :class:`Archiver` uses of its control plane: the store, settings, nodes and the seal store."""

    @property
    def archive(self) -> SealArchive | None: ...


class Archiver(LeaderLoop):
    """Runs :meth:`run_once` every ``settings.seal_store_seconds`` while this replica leads the ``seal-store``
    duty (nothing without a seal store). :meth:`start` first checks the store: a missing bucket or refused
    credentials raise ``StorageError`` then, so the server does not start with a store it can't use."""

    what = "seal store"
    pass_log = log

    def __init__(self, control: ArchivedPlane, period: float | None = None):
        arch = control.archive
        super().__init__(control.store.engine, "seal-store",
                         (control.settings.seal_store_seconds if period is None else period) if arch else 0)
        self.cp = control
        self.last: dict[str, Any] = {}
        self.swept = 0.0
        self.rescue = Rescue(control)

    def start(self) -> None:
        if self.cp.archive is not None:
            self.cp.archive.check()
        super().start()

    def run_once(self) -> dict[str, Any]:
        """Free what deleted sandboxes stored, bring back the running sandboxes of lost nodes, then upload up to
        :data:`BATCH` stopped sandboxes' new seals and as many running sandboxes' new automatic snapshots
        (:mod:`sbx.control.cluster.rescue`). Returns ``{"stored": [{"id", "node", "bytes", "sent", "seconds"}],
        "snapshots": [{"id", "snapshot", "node", "bytes", "sent", "seconds"}], "recovered": [the ``recovered``
        events], "failed": [{"id", "error"}], "freed": [object names]}``."""
        arch = self.cp.archive
        out: dict[str, Any] = {"stored": [], "snapshots": [], "recovered": [], "failed": [], "freed": []}
        if arch is None:
            return out
        cp = self.cp
        cp.registry.refresh()
        cands = {c.name: c for c in cp._candidates()}
        have = arch.all()
        rows = {r.id: r for r in cp.store.list_sandboxes(include_deleted=True)}
        for sid, a in have.items():
            r = rows.get(sid)
            if r is None or r.state == "deleted":
                out["freed"] += arch.free(a.account_id, arch.forget(sid))
        if time.monotonic() - self.swept >= SWEEP_EVERY or not self.swept:
            out["freed"] += arch.sweep()
            self.swept = time.monotonic()
        default = cp.router.default_name
        self.rescue.lost.update({n: c.status for n, c in cands.items()})
        for row in lost_todo(rows.values(), have, self.rescue.lost, set(cands), default):
            if self._stop.is_set():
                break
            self.rescue.recover(row, out)
        settled = utcnow() - dt.timedelta(seconds=min(SETTLE, self.period))
        todo = [r for r in rows.values() if r.state == "stopped" and not r.no_snapshots
                and (r.id not in have or as_utc(have[r.id].sealed_at) != as_utc(r.updated_at))
                and as_utc(r.updated_at) <= settled
                and cands.get(r.node or default) is not None and cands[r.node or default].status != "unreachable"]
        for row in todo[:BATCH]:
            if self._stop.is_set():
                break
            self._store(arch, row, have.get(row.id), out)
        newest = {s.sandbox_id: s for s in cp.store.list_snapshots(auto=True)}  # oldest first: the newest wins
        answering = {n for n, c in cands.items() if c.status != "unreachable"}
        for row, snap in snapshot_todo(rows.values(), arch.all(), newest, answering, default)[:BATCH]:
            if self._stop.is_set():
                break
            self.rescue.upload(row, snap, out)
        self.last = out
        return out

    def _store(self, arch: SealArchive, row: SandboxRow, old: ArchiveRow | None, out: dict[str, Any]) -> None:
        t0 = time.monotonic()
        node = row.node or self.cp.router.default_name
        try:
            manifest, objects, sent = arch.upload(self.cp.router.agent(node), row)
        except (NodeError, StorageError) as e:
            if getattr(e, "code", "") != "invalid_state":  # it resumed meanwhile: not a failure
                log.warning("storing the seal of %s failed (tried again next pass): %s", row.id, e)
                out["failed"].append({"id": row.id, "error": e.code})
            return
        if not arch.record(row, manifest, objects):  # it changed meanwhile: the upload is of an older seal
            out["freed"] += arch.free(row.account_id, list(objects.values()))
            return
        if old is not None:
            out["freed"] += arch.free(old.account_id, list(old.objects.values()))
        took = time.monotonic() - t0
        size = sum(int(f["size"]) for f in manifest["files"].values())
        log.info("stored the seal of %s from %s: %d bytes (%d sent) in %.2f s", row.id, node, size, sent, took)
        out["stored"].append({"id": row.id, "node": node, "bytes": size, "sent": sent, "seconds": took})
