"""Draining a node (issue 11): :class:`Drains`, behind ``sbx node drain NODE`` and ``POST /v1/nodes/{name}/drain``.

A drain cordons the node (no new sandbox goes there), then moves its sandboxes, in the order they were made,
``settings.drain_parallel`` at a time (``SBX_DRAIN_PARALLEL``, 2):

- a ``running`` sandbox is live-migrated (:meth:`sbx.control.sandboxes.migrating.MigrateOps.migrate`: placement picks a
  ``ready`` node with room and a matching fingerprint; same id, URL, PIDs, memory; its user sees a pause);
- a ``stopped`` one is moved with its disk and memory image (:func:`sbx.control.cluster.relocate.move_stopped`, as a
  resume on another node does), under a lifecycle hold so a resume waits for the move; placement prefers a node
  whose fingerprint matches (its memory image stays usable), else any ready node with room;
- one in an operation (starting, stopping...) is waited for first; one in ``error`` stays (``invalid_state``).

Two moves at once never take the same last room: each migration holds its memory against its destination from
placement to its commit point (``moving_to`` in :mod:`sbx.control.sandboxes.planebase`).

Each sandbox gets a result: ``done`` (with ``to``, and for a migration ``pauseS``/``totalS``), ``failed`` with a
stable error code (``insufficient_capacity`` when no other node has room or a matching CPU: the sandbox stays
where it is, running or stopped; ``migration_failed``, ``transfer_failed``... from the node layer: likewise),
or ``gone`` (deleted meanwhile). The drain ends with ``empty`` true when nothing is left on the node; the node
stays cordoned (``sbx node uncordon`` it, or ``sbx node remove`` it once empty).

Consolidation (:mod:`sbx.control.cluster.consolidate`) runs its drains here too, with a ``plan`` of destinations
(``{sandbox id: node}``; placement picks when a planned node no longer may take the sandbox) and ``reason``
``consolidation``; every drain's move events carry its ``reason`` (``drain`` for ``sbx node drain``). What
happens once a drain of a reason has finished is :attr:`Drains.finishers` (consolidation registers its own).

The record of a drain is a row of ``drains`` (migration 0012), written at every step, so every server replica
answers ``GET /v1/nodes/{name}/drain`` and the record outlives the process. The replica running a drain holds
the PostgreSQL advisory lock ``drain:<node>`` (:class:`sbx.control.store.locks.LeaderLock`) for as long as it runs;
a drain whose record says ``draining`` while nobody holds that lock was left by a replica that died (or, on
SQLite, by the server before it was killed): :meth:`Drains.resume_orphans` takes it over (at a server's start and
on every replica's orphan sweep, :mod:`sbx.control.cluster.orphans`), and its sandboxes not yet moved are moved as above
(``resumes`` counts the takeovers). The moves themselves are ordinary lifecycle operations, persisted and
crash-safe as such.
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from sqlalchemy import JSON, DateTime, String, select
from sqlalchemy.orm import Mapped, mapped_column

from sbx.config import Size
from sbx.control.cluster import placement
from sbx.control.cluster.relocate import MIGRATE_WAIT
from sbx.control.cluster.replicas import ReplicaBook
from sbx.control.cluster.view import ClusterView
from sbx.control.errors import ControlError
from sbx.control.store.database import Base, SandboxRow, iso, utcnow
from sbx.control.store.locks import LeaderLock
from sbx.control.store.state import TRANSIENT, Lifecycle
from sbx.node.types import NodeError

log = logging.getLogger("sbx.control")

FINISHED = ("done", "failed", "gone")
"""Statuses of a drain's sandbox that a resumed drain does not touch again."""


class DrainRow(Base):
    """A node's last drain (module docstring): ``record`` is the drain as ``GET /v1/nodes/{name}/drain`` shows it
    (shape in :meth:`Drains.start`; its reason, takeovers and outcome too), ``plan`` its ``{sandbox id: preferred
    destination}``, ``state`` mirrors the record's (``draining`` / ``done``) so the replicas can find the drains
    under way."""

    __tablename__ = "drains"

    node: Mapped[str] = mapped_column(String(64), primary_key=True)
    state: Mapped[str] = mapped_column(String(16))
    record: Mapped[dict[str, Any]] = mapped_column(JSON)
    plan: Mapped[dict[str, str]] = mapped_column(JSON)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class DrainPlane(ClusterView, Protocol):
    """What a drain uses of its control plane (:class:`sbx.control.service.ControlPlane` is one): the nodes, the
    store and lifecycle, placement's view of the nodes, and the two moves (live migration, a stopped sandbox's
    move)."""

    @property
    def lifecycle(self) -> Lifecycle: ...
    @property
    def replicas(self) -> ReplicaBook: ...
    @property
    def migration_figures(self) -> dict[str, dict[str, Any]]: ...
    def get(self, sandbox_id: str) -> SandboxRow: ...
    def migrate(self, sandbox_id: str, wait: float | None = None, prefer: str | None = None,
                reason: str | None = None, to: str | None = None) -> SandboxRow: ...
    def _size(self, name: str) -> Size: ...
    def _move(self, sandbox_id: str, src: str, dst: str, reason: str | None = None,
              replica: bool = False) -> None: ...


class Drains:
    """The node drains of the installation, as this replica sees and runs them (module docstring). Thread-safe."""

    def __init__(self, cp: DrainPlane):
        self.cp = cp
        self._guard = threading.Lock()
        self._local: dict[str, dict[str, Any]] = {}  # node -> the record of a drain this replica runs now
        self._locks: dict[str, LeaderLock] = {}
        self.finishers: dict[str, Callable[[dict[str, Any]], None]] = {}
        """``{reason: f}``: ``f(record)`` is called (in the drain's thread) once a drain of that reason has
        finished, on whichever replica finished it."""

    # the record ------------------------------------------------------------------------------------------------
    def _row(self, name: str) -> DrainRow | None:
        with self.cp.store.session() as s:
            return s.get(DrainRow, name)

    def get(self, name: str) -> dict[str, Any]:
        """The last drain of node ``name`` (a copy; shape in :meth:`start`), from any replica. Raises 404
        ``not_found`` when the node was never drained."""
        with self._guard:
            mine = self._local.get(name)
            if mine is not None:
                return copy.deepcopy(mine)
        row = self._row(name)
        if row is None:
            raise ControlError("not_found", f"node {name!r} was never drained", 404)
        return dict(row.record)

    def running(self) -> list[str]:
        """The nodes being drained now, by any replica (their record says ``draining``)."""
        with self.cp.store.session() as s:
            return list(s.scalars(select(DrainRow.node).where(DrainRow.state == "draining")))

    def _save(self, record: dict[str, Any], plan: dict[str, str] | None = None) -> None:
        """Write ``record`` (caller holds ``_guard``: a consistent copy) to its row; ``plan`` for a new drain."""
        with self.cp.store.session() as s, s.begin():
            row = s.get(DrainRow, record["node"])
            if row is None:
                row = DrainRow(node=record["node"], plan={})
                s.add(row)
            row.state, row.record, row.updated_at = record["state"], copy.deepcopy(record), utcnow()
            if plan is not None:
                row.plan = dict(plan)

    def _set(self, record: dict[str, Any], entry: dict[str, Any], **fields: Any) -> None:
        with self._guard:
            entry.update(fields)
            self._save(record)

    # running one -----------------------------------------------------------------------------------------------
    def _lock(self, name: str) -> bool:
        """Take (or keep) the lock that says this replica runs the drain of ``name``; False when another holds
        it (always True on SQLite)."""
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = LeaderLock(self.cp.store.engine, f"drain:{name}")
        return lock.try_lead()

    def start(self, name: str, plan: dict[str, str] | None = None, reason: str = "drain") -> dict[str, Any]:
        """Cordon node ``name`` and start draining it in a thread; returns the drain record at once (a drain
        already running there, on this replica or another, is returned as it is; one a dead replica left is
        taken over). ``plan``: ``{sandbox id: preferred destination}``; ``reason`` goes into the record and the
        move events::

            {"node", "reason", "state": "draining"|"done", "startedAt", "finishedAt", "empty": bool|None,
             "resumes": int,
             "sandboxes": [{"id", "name", "action": "migrate"|"move"|"none", "status": "pending"|"moving"|"done"|
                            "failed"|"gone", "from", "to", "error": {"code","message"}|None, "pauseS", "totalS",
                            "seconds"}]}

        Raises 404 ``not_found`` for an unknown node, 409 ``busy`` when another replica is starting a drain of it
        this very moment."""
        self.cp.registry.refresh()
        if self.cp.registry.row(name) is None:
            raise ControlError("not_found", f"no node {name!r} (see `sbx node list`)", 404)
        with self._guard:
            mine = self._local.get(name)
            if mine is not None:
                return copy.deepcopy(mine)
            if not self._lock(name):
                row = self._row(name)
                if row is not None and row.state == "draining":
                    return dict(row.record)
                raise ControlError("busy", f"another server is starting a drain of node {name}; try again", 409)
            try:
                row = self._row(name)
                if row is not None and row.state == "draining":  # nobody holds its lock: its replica died
                    return self._resume(row)
                self.cp.registry.cordon(name, True)
                default = self.cp.router.default_name
                rows = [r for r in self.cp.store.list_sandboxes() if (r.node or default) == name]
                entries = [{"id": r.id, "name": r.name,
                            "action": {"running": "migrate", "stopped": "move"}.get(r.state, "none"),
                            "status": "pending", "from": name, "to": None, "error": None, "pauseS": None,
                            "totalS": None, "seconds": None} for r in rows]
                record: dict[str, Any] = {"node": name, "reason": reason, "state": "draining",
                                          "startedAt": iso(utcnow()), "finishedAt": None, "empty": None,
                                          "resumes": 0, "sandboxes": entries}
                self._save(record, plan or {})
            except BaseException:  # nothing runs: the lock must not say this replica drains the node
                self._unlock(name)
                raise
            self._local[name] = record
            out = copy.deepcopy(record)
        log.info("draining node %s: %d sandboxes to move", name, len(entries))
        self._spawn(record, dict(plan or {}))
        return out

    def _resume(self, row: DrainRow) -> dict[str, Any]:
        """Take over the drain of ``row`` (caller holds ``_guard`` and the drain's lock)."""
        record = copy.deepcopy(dict(row.record))
        record["resumes"] = int(record.get("resumes") or 0) + 1
        left = [e["id"] for e in record["sandboxes"] if e["status"] not in FINISHED]
        log.warning("the drain of node %s was left unfinished by a server that is gone: taking it over (%d "
                    "sandboxes left to move)", row.node, len(left))
        self.cp.registry.cordon(row.node, True)  # still the drain's first step: nothing new goes there meanwhile
        self._save(record)
        self._local[row.node] = record
        self._spawn(record, dict(row.plan or {}))
        return copy.deepcopy(record)

    def resume_orphans(self) -> list[str]:
        """Take over every drain whose record says ``draining`` and whose replica is gone (nobody holds its lock);
        returns their nodes. Called at a server's start and on each orphan sweep."""
        taken = []
        for name in self.running():
            with self._guard:
                if name in self._local or not self._lock(name):
                    continue
                row = self._row(name)
                if row is None or row.state != "draining":
                    self._unlock(name)
                    continue
                self._resume(row)
                taken.append(name)
        return taken

    def _unlock(self, name: str) -> None:
        lock = self._locks.pop(name, None)
        if lock is not None:
            lock.release()

    def _spawn(self, record: dict[str, Any], plan: dict[str, str]) -> None:
        threading.Thread(target=self._run, args=(record, plan), name=f"sbx-drain-{record['node']}",
                         daemon=True).start()

    def _run(self, record: dict[str, Any], plan: dict[str, str]) -> None:
        name = record["node"]
        todo = [e for e in record["sandboxes"] if e["status"] not in FINISHED]
        try:
            with ThreadPoolExecutor(max(1, self.cp.settings.drain_parallel),
                                    thread_name_prefix=f"sbx-drain-{name}") as pool:
                for entry in todo:
                    pool.submit(self._one_entry, record, entry, plan.get(entry["id"]))
            default = self.cp.router.default_name
            left = [r.id for r in self.cp.store.list_sandboxes() if (r.node or default) == name]
            with self._guard:
                record.update(state="done", finishedAt=iso(utcnow()), empty=not left)
                self._save(record)
                done = copy.deepcopy(record)
            log.info("drained node %s: %s", name, "empty" if not left else f"{len(left)} sandboxes stay")
        except Exception:  # the database went away: the record stays "draining" and is taken over later
            log.exception("the drain of node %s stopped", name)
            return
        finally:
            with self._guard:
                self._local.pop(name, None)
                self._unlock(name)
        finish = self.finishers.get(done["reason"])
        if finish is not None:
            try:
                finish(done)
            except Exception:
                log.exception("after the drain of %s", name)

    def _one_entry(self, record: dict[str, Any], entry: dict[str, Any], prefer: str | None) -> None:
        name = record["node"]
        t0 = time.monotonic()
        try:
            self._one(record, entry, prefer)
        except (ControlError, NodeError) as e:
            self._set(record, entry, status="failed", error={"code": e.code, "message": e.message})
        except Exception as e:  # a bug: report it on this sandbox and go on with the others
            log.exception("draining %s: %s", name, entry["id"])
            self._set(record, entry, status="failed", error={"code": "internal", "message": f"{type(e).__name__}: {e}"})
        self._set(record, entry, seconds=round(time.monotonic() - t0, 3))
        err = entry["error"]
        log.info("draining %s: %s %s%s", name, entry["id"], entry["status"],
                 f" ({err['code']}: {err['message']})" if err else f" -> {entry['to']}" if entry["to"] else "")

    def _one(self, record: dict[str, Any], entry: dict[str, Any], prefer: str | None) -> None:
        """Move one sandbox off the drained node (to ``prefer`` when it may take it); records the outcome in
        ``entry``."""
        cp, sid, name, reason = self.cp, entry["id"], record["node"], record["reason"]
        row = cp.store.get_sandbox(sid)
        if row is not None and row.state in TRANSIENT:
            try:
                row = cp.lifecycle.wait_for(sid, {"running", "stopped"}, MIGRATE_WAIT)
            except ControlError as e:
                if e.code == "not_found":
                    row = None
                else:
                    raise
        if row is None or row.state == "deleted":
            self._set(record, entry, status="gone")
            return
        if (row.node or cp.router.default_name) != name:
            # it left: moved by this drain before a takeover (the action stays), or on its own (a resume elsewhere)
            self._set(record, entry, status="done", to=row.node,
                      action=entry["action"] if entry["status"] == "moving" else "none")
            return
        if row.state == "running":
            self._set(record, entry, action="migrate", status="moving")
            cp.migrate(sid, prefer=prefer, reason=reason)
            after = cp.lifecycle.wait_for(sid, {"running", "error"}, MIGRATE_WAIT)
            if (after.node or cp.router.default_name) != name and after.state == "running":
                fig = cp.migration_figures.get(sid, {})
                self._set(record, entry, status="done", to=after.node, pauseS=fig.get("pauseS"),
                          totalS=fig.get("totalS"))
            else:
                self._set(record, entry, status="failed", error={"code": after.error_code or "migration_failed",
                                                                 "message": after.error_message or ""})
            return
        if row.state == "stopped":
            self._set(record, entry, action="move", status="moving")
            with cp.lifecycle.hold(sid, {"stopped"}, MIGRATE_WAIT, "move it"):
                fresh = cp.get(sid)
                with cp.lifecycle.cond:
                    place = placement.choose_move(cp._candidates(exclude=sid), cp.settings, cp._size(fresh.type),
                                                  f"the move of {sid}", name, live=False,
                                                  has_memory=fresh.has_memory, prefer=prefer)
                rep = cp.replicas.get(sid)  # a seal replica already there saves the copy
                cp._move(sid, name, place.node, reason, replica=rep is not None and rep.node == place.node)
            self._set(record, entry, status="done", to=place.node)
            return
        raise ControlError("invalid_state", f"sandbox {sid} is {row.state}: it stays on node {name} (delete it, "
                           "or resume it elsewhere)", 409, row.state)

    def close(self) -> None:
        """Give up the locks of the drains this replica runs (at shutdown: their threads are daemons; another
        replica, or this server's next start, takes them over)."""
        with self._guard:
            for name in list(self._locks):
                self._unlock(name)
