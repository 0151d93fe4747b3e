"""Live migration of a running sandbox to another node, driven by the control plane (issue 11): :class:`MigrateOps`.

``migrate(id)`` is a lifecycle operation like a stop:

1. under the lifecycle lock, placement picks the destination (:func:`sbx.control.cluster.placement.choose_move`:
   never the sandbox's own node, only ``ready`` nodes with room whose memory-image fingerprint matches, each with
   a node API the source can send to) and the row goes ``running -> migrating`` (persisted before anything moves;
   an exec, a file call or a hosted-port request meanwhile waits for it as it waits for a resume); event
   ``migrating`` with ``from`` and ``to``;
2. a worker calls :func:`sbx.node.migration.live.migrate` with the two node clients of the router (the data goes node
   to node);
3. on success the row's ``node`` column is pointed at the destination (the commit point: every later call, hosted
   port and the sandbox's egress-proxy binding follow it), the egress-proxy binding is re-applied there when
   secrets are bound, and the row goes ``running``; event ``migrated`` with ``from``, ``to``, ``pauseS`` and
   ``totalS`` (seconds). Id, name, subdomain and URL are the row's: they don't change;
4. on failure the node layer guarantees the sandbox runs on its source: the row goes back to ``running`` there
   with ``error`` = the node's code (``migration_failed``, ``cpu_mismatch``, ``node_unreachable``...) and an event
   ``migrate_failed``. Only ``migration_unconfirmed`` (the source can't ask the destination whether it took over;
   the source keeps its copy paused) leaves the row in ``error`` with that code.

A migration a drain or consolidation makes carries ``reason`` (``drain``, ``consolidation``) in those events.

A server killed during a move: at its next start, before the nodes reconcile, :meth:`MigrateOps._find_migrated`
asks the source about each row still ``migrating`` (which waits for a node-level move still in flight: it holds
the sandbox's lock there) and, when the source no longer has it, asks every other node and points the row at the
one that runs it (a destination that confirmed), so the reconcile keeps that copy; otherwise the source's
reconcile settles it (it thaws a sandbox caught mid-move).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, cast

from sbx import metrics
from sbx.control.cluster import placement
from sbx.control.errors import ControlError
from sbx.control.sandboxes.admission import refused
from sbx.control.sandboxes.moving import MoveOps
from sbx.control.store.database import SandboxRow
from sbx.node.migration import live as livemove
from sbx.node.types import NodeError

log = logging.getLogger("sbx.control")

class MigrateOps(MoveOps):
    """``migrate``: a running sandbox moves to another node with its processes (module docstring)."""

    @functools.cached_property
    def migration_figures(self) -> dict[str, dict[str, Any]]:
        """``{sandbox id: figures}`` of each sandbox's last live migration from this replica (what
        :func:`sbx.node.migration.live.migrate` returned: ``pauseS``, ``totalS``, bytes...)."""
        return {}

    def _no_api(self) -> dict[str, str]:
        """``{node: why}`` of nodes a migration can't go to: the embedded node has no node API to receive one."""
        return {n: "it is this server's embedded node (no node API to receive a live migration)"
                for n, (url, _a) in self.router.agents().items() if url == "local"}

    def _migrate_place(self, row: SandboxRow, prefer: str | None = None, to: str | None = None) -> str:
        """The destination of ``row``'s live migration (caller holds the lifecycle lock): ``to`` when given (or an
        error saying why it can't take it), else ``prefer`` when it may take it, else the node placement picks.
        Raises 404 ``not_found`` (``to`` is no registered node), 409 ``invalid_destination`` (``to`` is the node it
        runs on), ``507 insufficient_capacity`` naming each node's reason."""
        current = row.node or self.router.default_name
        what = f"the live migration of {row.id}"
        cands = self._candidates(exclude=row.id)
        if to is not None:
            if to == current:
                raise ControlError("invalid_destination", f"sandbox {row.id} runs on node {to} already", 409)
            if not any(c.name == to for c in cands):
                raise ControlError("not_found", f"no node {to!r} (see `sbx node list`)", 404)
            cands = [c for c in cands if c.name in (to, current)]
        try:
            place = placement.choose_move(cands, self.settings, self._size(row.type), what, current, live=True,
                                          unusable=self._no_api(), prefer=prefer)
        except ControlError as err:
            refused(err)
            raise
        return place.node

    def migrate(self, sandbox_id: str, wait: float | None = None, prefer: str | None = None,
                reason: str | None = None, to: str | None = None) -> SandboxRow:
        """Start the live migration of running sandbox ``sandbox_id`` to node ``to`` (``sbx migrate ID --to
        NODE``; it must be able to take it), else to ``prefer`` when it may take it, else to the node placement
        picks; returns the row in ``migrating`` (its ``node`` still the source) at once, the move runs in a worker
        (module docstring). ``reason`` (``drain``, ``consolidation``) goes into its events. Raises 404 (no such
        sandbox, or no node ``to``), 409 ``not_running`` (not running once any operation in flight settled) /
        ``busy`` / ``invalid_destination`` (``to`` is its own node), 507 ``insufficient_capacity`` (no other ready
        node, or not ``to``, with room and a matching fingerprint): nothing changed on any error."""
        chosen: dict[str, str] = {}

        def check(row: SandboxRow) -> ControlError | None:
            if (row.runtime or "container") != "container":  # runsc restores on one host only (issue 33)
                return ControlError("not_supported", f"sandbox {row.id} is of the {row.runtime} runtime class, which "
                                    "can't live-migrate; stop it and resume it where it should run", 409, row.state)
            if self.volumes.of_sandbox(row.id):  # their mounts are made in its user namespace (issue 34)
                return ControlError("not_supported", f"sandbox {row.id} mounts volumes, which don't live-migrate "
                                    "yet; stop it and resume it where it should run", 409, row.state)
            if row.state != "running":
                return ControlError("not_running", f"sandbox {row.id} is {row.state}; only a running sandbox "
                                    "migrates (a stopped one moves when it resumes)", 409, row.state)
            chosen["src"] = row.node or self.router.default_name
            chosen["dst"] = self._migrate_place(row, prefer, to)
            self.moving_to[row.id] = (chosen["dst"], self._size(row.type).memory_mib)
            return None

        try:
            before, after = self.lifecycle.begin(sandbox_id, "migrating", check, wait, error_code=None,
                                                 error_message=None)
        except BaseException:
            self._unreserve(sandbox_id)
            raise
        src, dst = chosen["src"], chosen["dst"]
        why = {"reason": reason} if reason else {}
        self.add_event(sandbox_id, {"event": "migrating", "id": sandbox_id, "from": src, "to": dst, **why})
        spec = self._spec(before)

        def work() -> None:
            agents = self.router.agents()
            try:
                if dst not in agents:
                    raise NodeError("node_unknown", f"node {dst} is no longer registered")
                # both are node agents with the migration calls (LocalNode or RemoteNode)
                figures = livemove.migrate(cast(livemove.MigrationNode, self.router.agent(src)),
                                            cast(livemove.MigrationNode, agents[dst][1]), agents[dst][0], spec)
            except NodeError as e:
                self._unreserve(sandbox_id)
                self._migrate_failed(sandbox_id, src, dst, e, reason)
                return
            except BaseException:
                self._unreserve(sandbox_id)
                raise
            self._migrated(sandbox_id, src, dst, figures, reason)

        self._submit(sandbox_id, work, self._fail(sandbox_id))
        return after

    def _migrated(self, sandbox_id: str, src: str, dst: str, figures: dict[str, Any], reason: str | None = None
                  ) -> None:
        """The destination runs it: commit the node column, re-apply per-node settings, back to ``running``."""
        self.store.update_sandbox(sandbox_id, node=dst)  # the commit point
        self._unreserve(sandbox_id)  # the row counts against the destination now
        self.secrets.nodes.reapply(sandbox_id)  # the sandbox runs; a failed proxy binding is only logged
        self.activity.touch(sandbox_id)
        self.migration_figures[sandbox_id] = figures
        pause, total = figures.get("pauseS"), figures.get("totalS")
        if isinstance(pause, int | float):
            metrics.MIGRATION_PAUSE_SECONDS.observe(pause)
        log.info("migrated %s from %s to %s in %.2f s (paused %.2f s)", sandbox_id, src, dst, total or 0.0,
                 pause or 0.0)
        # the event before the settled state: a follower of the events until settled sees it
        self.add_event(sandbox_id, {"event": "migrated", "id": sandbox_id, "from": src, "to": dst,
                                    "pauseS": pause, "totalS": total, **({"reason": reason} if reason else {})})
        self.lifecycle.transition(sandbox_id, "running")

    def _migrate_failed(self, sandbox_id: str, src: str, dst: str, e: NodeError, reason: str | None = None
                        ) -> None:
        """The move failed: the sandbox runs on its source (``migration_unconfirmed``: ``error``)."""
        log.warning("migrating %s from %s to %s failed: %s: %s", sandbox_id, src, dst, e.code, e.message)
        state = "error" if e.code == "migration_unconfirmed" else "running"
        self.add_event(sandbox_id, {"event": "migrate_failed", "id": sandbox_id, "from": src, "to": dst,
                                    "state": state, "error": {"code": e.code, "message": e.message},
                                    **({"reason": reason} if reason else {})})
        self.lifecycle.transition(sandbox_id, state, error_code=e.code, error_message=e.message)

    def _find_migrated(self) -> None:
        """At start, before the nodes reconcile: a row still ``migrating`` whose sandbox another node runs now (the
        move was confirmed, the server died before the commit point) is pointed at that node."""
        for row in self.store.list_sandboxes():
            if row.state == "migrating":
                self._locate_migrated(row)

    def _locate_migrated(self, row: SandboxRow) -> str | None:
        """``row`` is ``migrating`` and its server is gone (this one restarted, or another replica died): when
        its source no longer has it and another node runs it (that move was confirmed before the commit point),
        point the row at that node and return its name; else None (still on its source, which settles it)."""
        current = row.node or self.router.default_name
        try:  # waits for the node-level move, which holds the sandbox's lock on its source, to end
            held = self.router.agent(current).status(row.id, settled=True)
        except NodeError:
            held = "absent"  # the source does not answer: a destination that runs it wins
        if held != "absent":
            return None  # still on its source: the source's reconcile settles it
        for name, (_url, agent) in self.router.agents().items():
            if name == current:
                continue
            try:
                status = agent.status(row.id)
            except NodeError:
                continue
            if status == "running":
                log.warning("%s was migrating when its server went away; node %s runs it: it is there now",
                            row.id, name)
                self.store.update_sandbox(row.id, node=name)
                return name
        return None
