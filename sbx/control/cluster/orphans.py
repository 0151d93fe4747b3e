"""Operations a dead replica left in flight (issue 10: several ``sbx server`` replicas on one PostgreSQL database).

A replica owns the operations it starts (:class:`sbx.control.store.locks.OpLocks`: an advisory lock from the transient
state to the final one, on a connection that dies with the process). When a replica is killed, its sandboxes stay
``stopping``, ``resuming``, ``forking``, ``provisioning`` or ``deleting`` in the database while the node finishes
or abandons the work it was given. :class:`OrphanSweeper` runs on every replica: every ``interval`` seconds it
looks for transient rows whose lock it can take (no live owner), asks the node what the sandbox is now
(:meth:`sbx.node.types.NodeAgent.status` with ``settled``: it waits for an operation still running on the node)
and settles the row as a server restart would (:meth:`sbx.control.service.ControlPlane.settle`): running,
stopped (with or without memory), an interrupted create or fork reported as ``error``/``interrupted``, a deletion
finished. A row left ``migrating`` whose move the nodes completed (the destination confirmed) is first pointed at
the destination (:meth:`sbx.control.sandboxes.migrating.MigrateOps._locate_migrated`). A node drain the dead replica was
running is taken over (:meth:`sbx.control.cluster.drain.Drains.resume_orphans`).

On SQLite there is one process, which reconciles everything when it starts, so the sweeper does nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from sbx.control.accounts.metering import Meter
from sbx.control.cluster.drain import Drains
from sbx.control.store.database import SandboxRow, Store
from sbx.control.store.state import TRANSIENT, Lifecycle
from sbx.node.types import NodeAgent, NodeError

log = logging.getLogger("sbx.control")


class SweptPlane(Protocol):
    """What :class:`OrphanSweeper` uses of its control plane (:class:`sbx.control.service.ControlPlane` is one):
    the store and lifecycle (whose operation locks say who owns what), the node, metering, the drains, and the
    plane's own settling of a row after a crash."""

    @property
    def store(self) -> Store: ...
    @property
    def lifecycle(self) -> Lifecycle: ...
    @property
    def node(self) -> NodeAgent: ...
    @property
    def meter(self) -> Meter: ...
    @property
    def drains(self) -> Drains: ...
    def settle(self, row: SandboxRow, status: str) -> None: ...
    def _locate_migrated(self, row: SandboxRow) -> str | None: ...


class OrphanSweeper:
    """Settles what dead replicas left (see the module docstring). :meth:`sweep` once; :meth:`start` runs it
    every ``interval`` seconds in a thread until :meth:`stop`."""

    def __init__(self, control: SweptPlane, interval: float = 3.0):
        self.control = control
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep(self) -> list[str]:
        """Settle every orphaned transient sandbox; returns their ids. A sandbox whose node does not answer is
        left for the next sweep."""
        ops = self.control.lifecycle.ops
        settled = []
        for row in self.control.store.list_sandboxes():
            if row.state not in TRANSIENT or ops.owns(row.id):
                continue
            with ops.orphaned(row.id) as orphan:
                if not orphan:
                    continue
                fresh = self.control.store.get_sandbox(row.id)  # its owner may have finished meanwhile
                if fresh is None or fresh.state not in TRANSIENT:
                    continue
                if fresh.state == "migrating" and self.control._locate_migrated(fresh) is not None:
                    fresh = self.control.store.get_sandbox(row.id) or fresh  # the destination took over
                try:
                    status = self.control.node.status(row.id, settled=True)
                except NodeError as e:
                    log.info("%s was left %s by a replica that is gone; its node does not answer yet: %s",
                             row.id, fresh.state, e.message)
                    continue
                log.warning("%s was left %s by a replica that is gone; the node reports it %s: settling it",
                            row.id, fresh.state, status)
                self.control.settle(fresh, status)
                settled.append(row.id)
        if settled:
            self.control.meter.reconcile()  # the dead replica could not close or open their usage intervals
        self.control.drains.resume_orphans()  # a drain whose replica died goes on here
        return settled

    def start(self) -> None:
        """Sweep every ``interval`` seconds (only where several replicas can exist: PostgreSQL)."""
        if self.control.lifecycle.ops.engine is None or self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self.interval):
                try:
                    self.sweep()
                except Exception:  # a database hiccup: the next sweep tries again
                    log.exception("orphan sweep failed")

        self._thread = threading.Thread(target=loop, name="sbx-orphans", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
