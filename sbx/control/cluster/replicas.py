"""Seal replicas (issue 10, "a stopped sandbox may resume on another node when its own is ... gone"):
:class:`Replicator`, the store's :class:`ReplicaRow` and :class:`LeftoverRow`, and :class:`ReplicaBook`.

A stopped sandbox's disk and memory image live on its node's volume, so a node that is gone would take its
stopped sandboxes with it. The replica of a seal is a copy of both on a second node
(:mod:`sbx.node.migration.replicas`):

- **Made** by a loop on the replica that leads the ``replicate`` duty (:class:`sbx.control.store.locks.LeaderLock`),
  every ``settings.replicate_seconds`` (``SBX_REPLICATE_SECONDS``, 10; 0 = off): each sandbox stopped for at
  least :data:`SETTLE` seconds (or the period when shorter) on a node that answers, with no current replica, is
  copied to another ready node (one whose memory-image fingerprint matches first, so its memory image stays
  usable there; then the most free disk), with the same delta and hash checks as a move (only the blocks that
  node's base image lacks, and the memory image). Up to :data:`BATCH` per pass.
- **Current** while the store's ``seal_replicas`` row exists: it is written only if the sandbox is still stopped
  with the ``updated_at`` it had when the copy began (under a row lock), and every change of the sandbox's state
  deletes it (a state hook, in the same transaction), as does any move of the sandbox.
- **Used** by a resume whose node is unreachable (or no longer registered): the sandbox resumes on the replica's
  node (:meth:`sbx.control.sandboxes.moving.MoveOps._resume_place`), which turns the replica into the sandbox
  (``promote_replica``), with its memory when the fingerprints match; id, name, subdomain and routes are the
  row's. A resume that moves anyway (its node is cordoned or full) takes the replica's node when it fits, saving
  the copy. Without a current replica such a resume fails with ``node_unreachable`` as before.
- **Dropped** from a node when the store no longer names it there (the loop asks each ready node what it holds),
  except for sandboxes in a transient state (a resume may be about to promote it).

A sandbox that left a node that did not answer (a resume from a replica, a move whose source delete failed)
leaves a copy there: ``node_leftovers`` lists it, and the loop deletes it once that node answers again (the node
agent restarted on its own keeps what it recorded: :meth:`sbx.node.lifecycle.reconcile.ReconcileMixin.recorded`).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any, Protocol

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, String, delete, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from sbx.control.cluster.placement import fingerprint_matches
from sbx.control.cluster.view import ClusterView
from sbx.control.store.database import Base, SandboxRow, Store, as_utc, utcnow
from sbx.control.store.locks import LeaderLoop
from sbx.control.store.state import TRANSIENT
from sbx.node.types import NodeError

log = logging.getLogger("sbx.replicas")

BATCH = 8
"""Sandboxes copied per pass at most (a pass's length stays bounded)."""

SETTLE = 5.0
"""Seconds a sandbox stays stopped before its seal is copied (at most the loop's period): a resume right after a
stop doesn't wait for a copy's export."""


class ReplicaRow(Base):
    """The current seal replica of a stopped sandbox: ``node`` holds it, ``bytes`` it took, ``memory`` (it has the
    memory image), ``fingerprint`` (of the node the image was made on), ``sealed_at`` (the sandbox's
    ``updated_at`` when the copy began), ``made_at``."""

    __tablename__ = "seal_replicas"

    sandbox_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    node: Mapped[str] = mapped_column(String(64))
    bytes: Mapped[int] = mapped_column(BigInteger)
    memory: Mapped[bool] = mapped_column(Boolean)
    fingerprint: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    sealed_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    made_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class LeftoverRow(Base):
    """A copy of sandbox ``sandbox_id`` left on ``node`` (which did not answer when the sandbox left it)."""

    __tablename__ = "node_leftovers"

    sandbox_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    node: Mapped[str] = mapped_column(String(64), primary_key=True)
    since: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


def forget_on_state_change(s: Session, row: SandboxRow, _old: str, _when: dt.datetime) -> None:
    """State hook (:attr:`sbx.control.store.database.Store.state_hooks`): a sandbox whose state changes has no current
    replica any more."""
    s.execute(delete(ReplicaRow).where(ReplicaRow.sandbox_id == row.id))


class ReplicaBook:
    """The store's side of seal replicas and leftovers (module docstring)."""

    def __init__(self, store: Store):
        self.store = store

    def get(self, sandbox_id: str) -> ReplicaRow | None:
        with self.store.session() as s:
            return s.get(ReplicaRow, sandbox_id)

    def all(self) -> dict[str, ReplicaRow]:
        with self.store.session() as s:
            return {r.sandbox_id: r for r in s.scalars(select(ReplicaRow))}

    def record(self, sandbox_id: str, node: str, sealed_at: dt.datetime, size: int, memory: bool,
               fingerprint: dict[str, str] | None) -> bool:
        """Write the replica row, only if the sandbox is still ``stopped`` with ``updated_at == sealed_at`` (the
        copy is of its current seal); True when written."""
        with self.store.session() as s, s.begin():
            row = s.scalars(select(SandboxRow).where(SandboxRow.id == sandbox_id).with_for_update()).first()
            if row is None or row.state != "stopped" or as_utc(row.updated_at) != as_utc(sealed_at):
                return False
            s.merge(ReplicaRow(sandbox_id=sandbox_id, node=node, bytes=size, memory=memory,
                               fingerprint=fingerprint, sealed_at=sealed_at, made_at=utcnow()))
        return True

    def forget(self, sandbox_id: str) -> None:
        with self.store.session() as s, s.begin():
            s.execute(delete(ReplicaRow).where(ReplicaRow.sandbox_id == sandbox_id))

    def add_leftover(self, sandbox_id: str, node: str) -> None:
        """Note that ``node`` still holds a copy of ``sandbox_id`` the store doesn't put there."""
        with self.store.session() as s, s.begin():
            s.merge(LeftoverRow(sandbox_id=sandbox_id, node=node, since=utcnow()))

    def leftovers(self) -> list[tuple[str, str]]:
        with self.store.session() as s:
            return [(r.sandbox_id, r.node) for r in s.scalars(select(LeftoverRow))]

    def clear_leftover(self, sandbox_id: str, node: str) -> None:
        with self.store.session() as s, s.begin():
            s.execute(delete(LeftoverRow).where(LeftoverRow.sandbox_id == sandbox_id, LeftoverRow.node == node))


class ReplicatedPlane(ClusterView, Protocol):
    """What :class:`Replicator` uses of its control plane (:class:`sbx.control.service.ControlPlane` is one): the
    store, settings, the nodes and placement's view of them, and the book of replicas."""

    @property
    def replicas(self) -> ReplicaBook: ...


class Replicator(LeaderLoop):
    """Runs :meth:`run_once` every ``period`` seconds (default ``settings.replicate_seconds``; 0: never), in a
    daemon thread between :meth:`start` and :meth:`stop`, while this replica leads the ``replicate`` duty
    (:class:`sbx.control.store.locks.LeaderLoop`; a copy under way is finished before :meth:`stop` returns)."""

    what = "replication"
    pass_log = log

    def __init__(self, control: ReplicatedPlane, period: float | None = None):
        super().__init__(control.store.engine, "replicate",
                         control.settings.replicate_seconds if period is None else period)
        self.cp = control
        self.book: ReplicaBook = control.replicas
        self.settle = min(self.period, SETTLE) if self.period > 0 else SETTLE
        self.last: dict[str, Any] = {}

    # one pass --------------------------------------------------------------------------------------------------
    def run_once(self) -> dict[str, Any]:
        """Remove leftovers and replicas the store doesn't name, then copy up to :data:`BATCH` stopped sandboxes
        that have no current replica. Returns ``{"copied": [{"id", "from", "to", "bytes", "seconds"}],
        "failed": [{"id", "from", "to", "error"}], "dropped": [[node, id]], "leftovers": [[node, id]]}``."""
        cp = self.cp
        cp.registry.refresh()
        cands = {c.name: c for c in cp._candidates()}
        ready = [n for n, c in cands.items() if c.status == "ready"]
        out: dict[str, Any] = {"copied": [], "failed": [], "dropped": [], "leftovers": []}
        # replicas before rows, rows before what the nodes hold: a resume promoting a replica meanwhile is then
        # seen as current, or as transient, never as a stale replica to drop
        have = self.book.all()
        rows = {r.id: r for r in cp.store.list_sandboxes()}
        default = cp.router.default_name
        self._clear_leftovers(rows, set(ready), default, out)
        self._drop_stale(rows, have, [n for n, c in cands.items() if c.status != "unreachable"], out)
        settled = utcnow() - dt.timedelta(seconds=self.settle)
        # a replica on a node that can't take a resume now (unreachable, cordoned, removed) is made again elsewhere
        todo = [r for r in rows.values() if r.state == "stopped" and not r.no_snapshots
                and (r.id not in have or have[r.id].node not in ready)
                and as_utc(r.updated_at) <= settled
                and cands.get(r.node or default) is not None and cands[r.node or default].status != "unreachable"]
        for row in todo[:BATCH]:
            if self._stop.is_set():
                break
            src = row.node or default
            dst = self._destination(cands, ready, src, row)
            if dst is None:
                continue
            self._copy(row, src, dst, cands[src].fingerprint, out)
        self.last = out
        return out

    def _clear_leftovers(self, rows: dict[str, SandboxRow], ready: set[str], default: str,
                         out: dict[str, Any]) -> None:
        for sid, node in self.book.leftovers():
            row = rows.get(sid)
            if row is not None and (row.node or default) == node:  # it came back there meanwhile: not a leftover
                self.book.clear_leftover(sid, node)
                continue
            if node not in ready:
                continue
            try:
                self.cp.router.agent(node).delete(sid)
            except NodeError as e:
                log.warning("the old copy of %s on %s stays for now: %s", sid, node, e.message)
                continue
            log.info("removed the old copy of %s from node %s", sid, node)
            self.book.clear_leftover(sid, node)
            out["leftovers"].append([node, sid])

    def _drop_stale(self, rows: dict[str, SandboxRow], have: dict[str, ReplicaRow], answering: list[str],
                    out: dict[str, Any]) -> None:
        """Drop the replicas each node in ``answering`` holds that are not the store's current one there."""
        for node in answering:
            agent: Any = self.cp.router.agent(node)
            try:
                held = agent.replicas()
            except (NodeError, AttributeError):
                continue
            for sid in held:
                row = rows.get(sid)
                if row is not None and row.state in TRANSIENT:  # a resume may be about to promote it
                    continue
                current = have.get(sid)
                if current is not None and current.node == node:
                    continue
                try:
                    agent.drop_replica(sid)
                except NodeError as e:
                    log.warning("dropping the replica of %s on %s: %s", sid, node, e.message)
                    continue
                out["dropped"].append([node, sid])

    def _destination(self, cands: dict[str, Any], ready: list[str], src: str, row: SandboxRow) -> str | None:
        """The ready node (not ``src``) a replica of ``row`` goes to: a matching fingerprint first, then the most
        free disk; None when no other node is ready or none has a reserve's worth of free disk."""
        reserve = int(self.cp.settings.disk_reserve_gib * (1 << 30))
        fp = cands[src].fingerprint
        pool = [cands[n] for n in ready if n != src and cands[n].host.disk_free_bytes > reserve]
        if not pool:
            return None
        best = max(pool, key=lambda c: (row.has_memory and fingerprint_matches(c.fingerprint, fp),
                                        c.host.disk_free_bytes))
        return str(best.name)

    def _copy(self, row: SandboxRow, src: str, dst: str, fingerprint: dict[str, str], out: dict[str, Any]) -> None:
        t0 = time.monotonic()
        # the transfer calls (sbx.node.migration.transfer), as sbx.control.cluster.relocate
        a: Any = self.cp.router.agent(src)
        b: Any = self.cp.router.agent(dst)
        try:
            manifest = a.export_stopped(row.id, b.transfer_parent(), kind="replica")
            try:
                b.begin_replica(manifest)
                for name in manifest["files"]:
                    b.replica_stream(row.id, name, a.export_file(row.id, name, kind="replica"))
                sealed = b.seal_replica(row.id)
            finally:
                try:
                    a.end_export(row.id, kind="replica")
                except NodeError as e:
                    log.warning("cleaning up the replica export of %s on %s: %s", row.id, src, e.message)
        except NodeError as e:
            if e.code != "invalid_state":  # it resumed meanwhile: not a failure
                log.warning("replicating %s from %s to %s failed: %s: %s", row.id, src, dst, e.code, e.message)
                out["failed"].append({"id": row.id, "from": src, "to": dst, "error": e.code})
            try:
                b.drop_replica(row.id)
            except NodeError:
                pass
            return
        if not self.book.record(row.id, dst, row.updated_at, int(sealed["bytes"]), bool(sealed["memory"]),
                                fingerprint if sealed["memory"] else None):
            b.drop_replica(row.id)  # it changed meanwhile: the copy is of an older seal
            return
        took = time.monotonic() - t0
        log.info("replicated %s from %s to %s: %d bytes in %.2f s", row.id, src, dst, sealed["bytes"], took)
        out["copied"].append({"id": row.id, "from": src, "to": dst, "bytes": sealed["bytes"], "seconds": took})
