"""Draining a node (issue 11): :class:`Drains`, behind ``sbx node drain NODE`` and ``POST /v1/nodes/{name}/drain``.

A drain cordons the node (no new sandbox goes there), then, one sandbox at a time, in the order they were made:

- a ``running`` sandbox is live-migrated (:meth:`sbx.control.migrating.MigrateOps.migrate`: placement picks a
  ``ready`` node with room and a matching fingerprint; same id, URL, PIDs, memory; its user sees a pause);
- a ``stopped`` one is moved with its disk and memory image (:func:`sbx.control.relocate.move_stopped`, as a
  resume on another node does), under a lifecycle hold so a resume waits for the move; placement prefers a node
  whose fingerprint matches (its memory image stays usable), else any ready node with room;
- one in an operation (starting, stopping...) is waited for first; one in ``error`` stays (``invalid_state``).

Each sandbox gets a result: ``done`` (with ``to``, and for a migration ``pauseS``/``totalS``), ``failed`` with a
stable error code (``insufficient_capacity`` when no other node has room or a matching CPU: the sandbox stays
where it is, running or stopped; ``migration_failed``, ``transfer_failed``... from the node layer: likewise),
or ``gone`` (deleted meanwhile). The drain ends with ``empty`` true when nothing is left on the node; the node
stays cordoned (``sbx node uncordon`` it, or ``sbx node remove`` it once empty).

Consolidation (:mod:`sbx.control.consolidate`) runs its drains here too, with a ``plan`` of destinations
(``{sandbox id: node}``; placement picks when a planned node no longer may take the sandbox) and ``reason``
``consolidation``; every drain's move events carry its ``reason`` (``drain`` for ``sbx node drain``).

The record of a drain lives in the memory of the replica that runs it (``GET /v1/nodes/{name}/drain`` on that
replica); the moves themselves are ordinary lifecycle operations, persisted and crash-safe as such.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sbx.control import placement
from sbx.control.errors import ControlError
from sbx.control.migrating import MIGRATE_WAIT
from sbx.control.state import TRANSIENT
from sbx.control.store import iso, utcnow
from sbx.node.types import NodeError

if TYPE_CHECKING:
    from sbx.control.service import ControlPlane

log = logging.getLogger("sbx.control")


class Drains:
    """The drains this replica runs, by node name (module docstring). Thread-safe."""

    def __init__(self, cp: ControlPlane):
        self.cp = cp
        self._guard = threading.Lock()
        self._drains: dict[str, dict[str, Any]] = {}

    def get(self, name: str) -> dict[str, Any]:
        """The last drain of node ``name`` this replica ran (a copy; shape in :meth:`start`). Raises 404
        ``not_found`` when it ran none."""
        with self._guard:
            d = self._drains.get(name)
            if d is None:
                raise ControlError("not_found", f"no drain of node {name!r} on this server", 404)
            return copy.deepcopy(d)

    def running(self) -> list[str]:
        """The nodes this replica is draining now."""
        with self._guard:
            return [n for n, d in self._drains.items() if d["state"] == "draining"]

    def start(self, name: str, plan: dict[str, str] | None = None, reason: str = "drain",
              on_done: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Cordon node ``name`` and start draining it in a thread; returns the drain record at once (a drain
        already running there is returned as it is). ``plan``: ``{sandbox id: preferred destination}``;
        ``reason`` goes into the record and the move events; ``on_done(record)`` is called (in the drain's
        thread) once it has finished::

            {"node", "reason", "state": "draining"|"done", "startedAt", "finishedAt", "empty": bool|None,
             "sandboxes": [{"id", "name", "action": "migrate"|"move"|"none", "status": "pending"|"moving"|"done"|
                            "failed"|"gone", "from", "to", "error": {"code","message"}|None, "pauseS", "totalS",
                            "seconds"}]}

        Raises 404 ``not_found`` for an unknown node."""
        self.cp.registry.refresh()
        if self.cp.registry.row(name) is None:
            raise ControlError("not_found", f"no node {name!r} (see `sbx node list`)", 404)
        with self._guard:
            running = self._drains.get(name)
            if running is not None and running["state"] == "draining":
                return copy.deepcopy(running)
            self.cp.registry.cordon(name, True)
            default = self.cp.router.default_name
            rows = [r for r in self.cp.store.list_sandboxes() if (r.node or default) == name]
            entries = [{"id": r.id, "name": r.name,
                        "action": {"running": "migrate", "stopped": "move"}.get(r.state, "none"),
                        "status": "pending", "from": name, "to": None, "error": None, "pauseS": None,
                        "totalS": None, "seconds": None} for r in rows]
            record: dict[str, Any] = {"node": name, "reason": reason, "state": "draining", "startedAt": iso(utcnow()),
                                      "finishedAt": None, "empty": None, "sandboxes": entries}
            self._drains[name] = record
            out = copy.deepcopy(record)
        log.info("draining node %s: %d sandboxes to move", name, len(entries))
        threading.Thread(target=self._run, args=(record, dict(plan or {}), on_done), name=f"sbx-drain-{name}",
                         daemon=True).start()
        return out

    def _set(self, entry: dict[str, Any], **fields: Any) -> None:
        with self._guard:
            entry.update(fields)

    def _run(self, record: dict[str, Any], plan: dict[str, str],
             on_done: Callable[[dict[str, Any]], None] | None) -> None:
        name = record["node"]
        for entry in record["sandboxes"]:
            t0 = time.monotonic()
            try:
                self._one(name, entry, plan.get(entry["id"]), record["reason"])
            except ControlError as e:
                self._set(entry, status="failed", error={"code": e.code, "message": e.message})
            except NodeError as e:
                self._set(entry, status="failed", error={"code": e.code, "message": e.message})
            except Exception as e:  # a bug: report it on this sandbox and go on with the others
                log.exception("draining %s: %s", name, entry["id"])
                self._set(entry, status="failed", error={"code": "internal", "message": f"{type(e).__name__}: {e}"})
            self._set(entry, seconds=round(time.monotonic() - t0, 3))
            err = entry["error"]
            log.info("draining %s: %s %s%s", name, entry["id"], entry["status"],
                     f" ({err['code']}: {err['message']})" if err else f" -> {entry['to']}" if entry["to"] else "")
        default = self.cp.router.default_name
        left = [r.id for r in self.cp.store.list_sandboxes() if (r.node or default) == name]
        with self._guard:
            record.update(state="done", finishedAt=iso(utcnow()), empty=not left)
        log.info("drained node %s: %s", name, "empty" if not left else f"{len(left)} sandboxes stay")
        if on_done is not None:
            try:
                on_done(self.get(name))
            except Exception:
                log.exception("after the drain of %s", name)

    def _one(self, name: str, entry: dict[str, Any], prefer: str | None, reason: str) -> None:
        """Move one sandbox off node ``name`` (to ``prefer`` when it may take it); records the outcome in
        ``entry``."""
        cp, sid = self.cp, entry["id"]
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
            self._set(entry, status="gone")
            return
        if (row.node or cp.router.default_name) != name:
            self._set(entry, status="done", to=row.node, action="none")  # it left on its own (a resume elsewhere)
            return
        if row.state == "running":
            self._set(entry, action="migrate", status="moving")
            cp.migrate(sid, prefer=prefer, reason=reason)
            after = cp.lifecycle.wait_for(sid, {"running", "error"}, MIGRATE_WAIT)
            if (after.node or cp.router.default_name) != name and after.state == "running":
                fig = cp.migration_figures.get(sid, {})
                self._set(entry, status="done", to=after.node, pauseS=fig.get("pauseS"), totalS=fig.get("totalS"))
            else:
                self._set(entry, status="failed", error={"code": after.error_code or "migration_failed",
                                                         "message": after.error_message or ""})
            return
        if row.state == "stopped":
            self._set(entry, action="move", status="moving")
            with cp.lifecycle.hold(sid, {"stopped"}, MIGRATE_WAIT, "move it"):
                fresh = cp.get(sid)
                with cp.lifecycle.cond:
                    place = placement.choose_move(cp._candidates(exclude=sid), cp.settings, cp._size(fresh.type),
                                                  f"the move of {sid}", name, live=False,
                                                  has_memory=fresh.has_memory, prefer=prefer)
                rep = cp.replicas.get(sid)  # a seal replica already there saves the copy
                cp._move(sid, name, place.node, reason, replica=rep is not None and rep.node == place.node)
            self._set(entry, status="done", to=place.node)
            return
        raise ControlError("invalid_state", f"sandbox {sid} is {row.state}: it stays on node {name} (delete it, "
                           "or resume it elsewhere)", 409, row.state)
