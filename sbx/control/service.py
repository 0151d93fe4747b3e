"""The control plane's operations on sandboxes, snapshots and jobs, on top of a :class:`NodeAgent`.

Long operations (create, stop, resume, fork, delete) persist their transient state, return at once and run the
node call in a worker thread; the final state (or ``error``) and an event follow. Short ones (snapshot, exec,
jobs) run in the caller's thread. Rules come from the seed guides:

- sizes only grow on resume (``400 invalid_resize``); a resize always cold-boots and reports
  ``memoryRestored: false, resumeReason: "resized"``; ``require_memory`` with a size change is
  ``400 invalid_require_memory``; a resume keeps the sandbox's ttl unless one is given;
- a fork copies type and env unless overridden, is named ``"<source name> (fork)"`` by default, gets
  ``settings.fork_default_ttl`` (one hour) unless given, and reports ``memoryRestored``/``resumeReason`` null;
- a sandbox created with ``no_snapshots`` cannot be resumed, forked or snapshotted (``409 snapshots_disabled``);
  its stop keeps only the disk.

Errors are :class:`sbx.control.errors.ControlError`.

The control plane is split by mechanism; :class:`ControlPlane` combines the parts:

- :mod:`sbx.control.sandboxes.planebase`: shared state, sandbox views, events, the worker pool, lookups and waits
  (with :mod:`sbx.control.sandboxes.admission`: placement's view of the nodes and the plans' limits);
- :mod:`sbx.control.sandboxes.operations`: create, stop, resume (resize), fork, delete;
- :mod:`sbx.control.sandboxes.moving`, :mod:`sbx.control.sandboxes.forking`: a resume or a fork on another node;
- :mod:`sbx.control.sandboxes.migrating`: live migration of a running sandbox to another node;
- :mod:`sbx.control.sandboxes.snapshotting`: named and automatic snapshots;
- :mod:`sbx.control.sandboxes.execjobs`: execs and detached jobs;
- collaborators that take the plane as a narrow protocol of their own, made here: routes, files, secrets and
  accounts that end (:mod:`sbx.control.sandboxes.routes`, :mod:`sbx.control.sandboxes.files`,
  :mod:`sbx.control.secrets.vault`, :mod:`sbx.control.cluster.accountend`),
  node drains (:mod:`sbx.control.cluster.drain`) and the sweep of operations a dead replica left in flight
  (:mod:`sbx.control.cluster.orphans`);
- this module: start (reconcile with the node), settling a row after a crash, sandboxes that ended on their
  own, nodes added and removed, close.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from sbx.config import Settings
from sbx.control.cluster.accountend import AccountEnds
from sbx.control.cluster.capacity import HostResources
from sbx.control.cluster.drain import Drains
from sbx.control.cluster.orphans import OrphanSweeper
from sbx.control.errors import ControlError
from sbx.control.images.catalog import Images
from sbx.control.sandboxes.activity import Activity
from sbx.control.sandboxes.execjobs import DEFAULT_EXEC_TIMEOUT, ExecOps
from sbx.control.sandboxes.files import Files
from sbx.control.sandboxes.operations import DEFAULT_TTL, LifecycleOps
from sbx.control.sandboxes.planebase import START_WAIT
from sbx.control.sandboxes.routes import Routes
from sbx.control.sandboxes.snapshotting import SNAPSHOT_NAME_RE, SnapshotOps
from sbx.control.sandboxes.views import job_view, snapshot_view
from sbx.control.secrets.vault import Secrets
from sbx.control.store.database import SandboxRow, Store
from sbx.control.store.state import DEFAULT_WAIT
from sbx.control.volumes.catalog import Volumes
from sbx.node.types import NodeAgent, NodeError

log = logging.getLogger("sbx.control")

__all__ = ["DEFAULT_EXEC_TIMEOUT", "DEFAULT_TTL", "SNAPSHOT_NAME_RE", "START_WAIT", "Activity", "ControlPlane",
           "job_view", "snapshot_view"]


class ControlPlane(LifecycleOps, SnapshotOps, ExecOps):
    """All sandbox operations for one node. Thread-safe.

    ``settings`` gives sizes, domain and defaults; ``node`` does the work; ``store`` defaults to a
    :class:`Store` at ``settings.db_url``; ``wait`` bounds how long a conflicting request waits for an operation in
    flight (seconds); ``workers`` sizes the pool that runs the long operations. ``host`` measures the host for
    admission (default :func:`sbx.control.cluster.capacity.probe_host`); ``trim`` gives freed volume space back
    to the host (default :func:`sbx.storage.volume.trim_volume`, run by a :class:`Trimmer`). Call :meth:`start`
    once (reconciles with the node), :meth:`close` at shutdown.
    """

    def __init__(
        self,
        settings: Settings,
        node: NodeAgent,
        store: Store | None = None,
        wait: float = DEFAULT_WAIT,
        workers: int = 8,
        host: Callable[[], HostResources] | None = None,
        trim: Callable[[int | None], int | None] | None = None,
    ):
        super().__init__(settings, node, store, wait, workers, host, trim)
        # the collaborators that take the plane itself, each typed by its own protocol (which the plane satisfies)
        self.routes = Routes(self)
        self.files = Files(self)
        self.secrets = Secrets(self)
        self.images = Images(self)
        self.volumes = Volumes(self)
        self.account_ends = AccountEnds(self)

    @functools.cached_property
    def drains(self) -> Drains:
        """The node drains this replica runs (:mod:`sbx.control.cluster.drain`)."""
        return Drains(self)

    @functools.cached_property
    def orphans(self) -> OrphanSweeper:
        """What settles operations dead replicas left in flight (:mod:`sbx.control.cluster.orphans`)."""
        return OrphanSweeper(self)

    # start / stop ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Reconcile the store with what the node has (call once, after ``node.prepare``): sandboxes left in a
        transient state by a crash settle to what the node reports; a deletion in flight is finished.

        When other replicas are alive on the same (PostgreSQL) database they are using the node right now: the
        node is left as it is (a node agent reconciles itself when it starts) and only the operations no live
        replica owns are settled (:class:`sbx.control.cluster.orphans.OrphanSweeper`, which also runs every few seconds
        from then on)."""
        self.lifecycle.ops.register()
        if self.lifecycle.ops.others_alive():
            log.info("other replicas are alive: settling only what dead replicas left in flight")
            self.orphans.sweep()
        else:
            self._find_migrated()  # a move the node layer finished but this server did not record
            rows = self.store.list_sandboxes()
            found = self.node.reconcile({r.id: r.state for r in rows})
            for row in rows:
                self.settle(row, found.get(row.id, "absent"))
        repaired = self.meter.reconcile()
        if repaired:
            log.info("metering: %d intervals repaired at start", repaired)
        self.node.watch(self._on_node_exit)
        self.registry.start()  # its first beat learns the configured node's own name, which the store's rows carry
        # every node's proxy asks through the rule of sbx.control.secrets.nodes; a node reached anew is re-told
        self.router.serve_egress_nodes(self.secrets.nodes.handler_for, self.secrets.nodes.sync_node)
        self.secrets.sync_all()
        self.trimmer.start()
        self.sampler.start()
        self.orphans.start()
        self.drains.resume_orphans()  # a drain the last server (or a dead replica) did not finish goes on here
        self.account_ends.finish_pending()  # an account deletion cut short goes on; suspended ones stay stopped

    def settle(self, row: SandboxRow, status: str) -> None:
        """Make ``row`` agree with ``status``, what the node reports for it (``running``, ``checkpointed``,
        ``stopped`` or ``absent``), after its operation was cut short by a crash: running and stopped rows follow
        the node, a deletion in flight is finished, a create or fork whose disk the node does not have becomes
        ``error``/``interrupted``, anything else the node has no trace of ``error``/``lost``. A fork cut short while
        made on its source's node for another node loses that copy (:meth:`ForkOps._settle_fork_copy`)."""
        if row.state == "deleting":
            self.store.update_sandbox(row.id, state="error", error_code=None, error_message=None)
            self.delete(row.id, wait=0)
            return
        self._settle_fork_copy(row)  # a fork cut short while made on its source's node for another one
        target = {"running": "running", "checkpointed": "stopped", "stopped": "stopped"}.get(status)
        if target is None:
            if row.state in ("forking", "provisioning"):  # the node removed the half-made disk
                self.store.update_sandbox(
                    row.id, state="error", error_code="interrupted",
                    error_message="the server stopped before the sandbox's disk was complete; delete it "
                                  "and create (or fork) again",
                )
                self._on_transition(self.store.get_sandbox(row.id) or row, row.state)
            elif row.state != "error":
                self.store.update_sandbox(
                    row.id, state="error", error_code="lost", error_message="the node has no trace of it"
                )
                self._on_transition(self.store.get_sandbox(row.id) or row, row.state)
            return
        if row.state != target:
            fields: dict[str, Any] = {"has_memory": status == "checkpointed"}
            if target == "stopped":
                fields.update(memory_saved=status == "checkpointed", memory_restored=None, resume_reason=None,
                              stop_reason="requested" if row.state == "stopping" else "interrupted")
            updated = self.store.update_sandbox(row.id, state=target, **fields)
            self._on_transition(updated, row.state)
        if target == "running":
            self.activity.touch(row.id)

    # nodes -----------------------------------------------------------------------------------------------------
    def add_node(self, url: str, token: str) -> dict[str, Any]:
        """Add the node agent at ``url`` with its node ``token`` (:meth:`sbx.control.cluster.router.NodeRouter.add`);
        its registry view. Raises 400 ``node_unauthorized``/``invalid_url``/``invalid_node_name``, 502
        ``node_unreachable`` (and other node failures), 409 ``node_configured`` when it is this server's own node."""
        if url.rstrip("/") == self.router.default_url.rstrip("/"):
            raise ControlError("node_configured", f"{url} is this server's own node already", 409)
        try:
            name, _info = self.router.add(url, token)
        except NodeError as e:
            status = 400 if e.code == "node_unauthorized" or e.code.startswith("invalid_") else 502
            raise ControlError(e.code, e.message, status) from None
        self.registry.refresh()
        row = self.registry.row(name)
        assert row is not None
        return self.registry.view(row)

    def remove_node(self, name: str) -> dict[str, Any]:
        """Forget the added node ``name``; its last view. Raises 404, 409 ``node_configured`` (the server's own
        node), 409 ``node_in_use`` (sandboxes that are not deleted are on it)."""
        self.registry.refresh()
        row = self.registry.row(name)
        if row is None:
            raise ControlError("not_found", f"no node {name!r} (see `sbx node list`)", 404)
        if name == self.router.default_name or not row.token:
            raise ControlError("node_configured", f"node {name} is a server's configured node (SBX_NODE_URL or "
                                                  "the embedded one), not an added one", 409)
        held = [r.id for r in self.store.list_sandboxes() if r.node == name]
        if held:
            raise ControlError("node_in_use", f"node {name} holds {len(held)} sandboxes ({', '.join(held[:5])}); "
                                              "delete them, or cordon the node and resume them elsewhere", 409)
        view = self.registry.view(row)
        self.store.remove_node(name)
        self.router.forget(name)
        self.registry.refresh()
        return view

    def _on_node_exit(self, sandbox_id: str, kind: str, detail: str | None) -> None:
        """The node noticed that a running sandbox ended on its own (called from the node's watcher thread).
        ``poweroff``/``crashed``: the sandbox is ``stopped`` with ``stopReason`` = kind (``stopError`` = the
        crash's detail), disk kept, no memory. ``reboot``: it boots again from its disk and reports
        ``resumeReason: "reboot"``. An ``exited`` event with the reason comes first."""
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row.state != "running":
            return
        self.add_event(sandbox_id, {"event": "exited", "id": sandbox_id, "reason": kind, "detail": detail})
        try:
            row = self.lifecycle.transition(
                sandbox_id, "stopped", has_memory=False, memory_saved=False, stop_reason=kind, stop_error=detail,
                memory_restored=None, resume_reason=None,
            )
            if kind != "reboot":
                return
            row = self.lifecycle.transition(sandbox_id, "resuming")
        except ControlError as e:  # an operation got there first
            log.info("%s ended (%s) but is %s: %s", sandbox_id, kind, e.state, e.message)
            return
        spec = self._spec(row)

        def work() -> None:
            self.node.resume(sandbox_id, spec, cold=False)
            self.activity.touch(sandbox_id)
            self.lifecycle.transition(sandbox_id, "running", has_memory=False, memory_restored=False,
                                      resume_reason="reboot")

        self._submit(sandbox_id, work, self._fail(sandbox_id))

    def close(self) -> None:
        """Finish operations in flight and release the database."""
        if self._closed:
            return
        self._closed = True
        self.account_ends.close()
        self.node.unwatch()
        self.orphans.stop()
        self.drains.close()
        self.registry.stop()
        self.sampler.stop()
        self._pool.shutdown(wait=True)
        self.node.close_egress()
        self.trimmer.stop()
        self.lifecycle.ops.close()
        self.store.close()
