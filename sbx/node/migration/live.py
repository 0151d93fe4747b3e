"""Live migration of a running sandbox to another node (issue 11): the steps, and :func:`migrate`, the caller's
whole move (a control plane's ``migrate``/``drain`` calls it with two node clients). The source's side is
:mod:`sbx.node.migration.outgoing`, the destination's :mod:`sbx.node.migration.incoming`.

The steps:

1. the caller asks the destination to prepare (``migrate_prepare``): a record ``incoming`` with an address of the
   destination's subnet, a uid range, a one-time ticket, and the digest of its base image;
2. the caller asks the source to move the sandbox there (``migrate_out`` with the destination's URL and the
   ticket); data goes straight from node to node, never through the caller:
   - pre-copy, while the sandbox runs: its disk is reflinked under ``fsfreeze`` and sent as a delta against the
     base image (when both nodes hold the same one; else in full);
   - the destination opens a page server for this move (``POST .../pages``, :mod:`sbx.runtime.pageserver`: one
     connection, from this node's address only);
   - freeze: the container is paused (cgroup freezer; from here on no task of it runs), its established TCP
     connections are destroyed (``SOCK_DESTROY`` through ``ss -K``: each peer gets a reset at once), and the memory
     dumped with ``runc checkpoint --leave-running --page-server`` (the container stays paused): the pages go to
     the destination's page server while CRIU dumps them, the other images are streamed afterwards; beside the
     dump the disk is synced (syncfs: no task runs, every write has returned), reflinked again and sent as a delta
     against the pre-copy;
   - the destination restores and pauses the copy; the source marks itself ``handover`` and tells it to go on;
     once the destination confirms, ``migrate_out`` answers and the source deletes its copy in the background
     (:meth:`MigrationMixin._depart`: the copy stays paused in phase ``handover`` meanwhile, and a restart
     before the delete settles it as below).
3. any failure before the confirmation: the destination's arrival is aborted (best effort; a destination that
   is down removes it at its next start), the source's container is unpaused and the sandbox runs on with its
   processes; ``migrate_out`` raises ``NodeError("migration_failed")`` saying which step failed and why.

Memory is sent in one dump, its pages straight to the destination as CRIU reads them (a destination without
``POST .../pages``, an earlier version, answers 404: then the pages are streamed with the other images after the
dump). Not pre-dumps: this kernel has no soft-dirty tracking, so CRIU's iterative pre-dump is impossible; not
lazy pages: the restore waits for every page. ``docs/migration.md`` has the figures.

The one uncertain moment is a confirmation whose answer is lost: the source then asks the destination where the
sandbox stands (``running`` there: the source deletes its copy; still ``incoming`` or gone: the source takes it
back) and, when the destination can't be reached, keeps its copy paused in phase ``handover`` and raises
``NodeError("migration_unconfirmed")``: the sandbox never runs on two nodes at once. A source agent restarted in
that phase asks the same question (:meth:`MigrationMixin._reconcile_migration`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from sbx.node.types import NodeError, NodeInfo, SandboxSpec

log = logging.getLogger("sbx.node")


class MigrationNode(Protocol):
    """What :func:`migrate` needs of the two nodes (a :class:`sbx.node.agent.LocalNode` or a
    :class:`sbx.node.remote.client.RemoteNode`)."""

    def info(self) -> NodeInfo: ...

    def migrate_prepare(self, spec: SandboxSpec, fingerprint: dict[str, str]) -> dict[str, Any]: ...

    def migrate_out(self, id: str, target: str, ticket: str,
                    image: dict[str, str] | None = None) -> dict[str, Any]: ...

    def migrate_abort(self, id: str) -> bool: ...


def migrate(source: MigrationNode, destination: MigrationNode, destination_url: str, spec: SandboxSpec,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Move the running sandbox ``spec.id`` from ``source`` to ``destination`` (whose node API answers at
    ``destination_url``, reachable from the source's node). Returns the source's figures plus ``totalS``
    (trigger to the destination running it, seconds).

    Raises ``NodeError``: ``cpu_mismatch``, ``exists`` (from the destination's prepare: nothing changed),
    ``migration_failed`` (the sandbox runs on the source), ``migration_unconfirmed`` (see the module docstring).
    An arrival the destination prepared is removed again when the move fails."""
    say = progress or (lambda _m: None)
    t0 = time.monotonic()
    prepared = destination.migrate_prepare(spec, source.info().fingerprint)
    say(f"{spec.id}: the destination is ready")
    try:
        figures = source.migrate_out(spec.id, destination_url, prepared["ticket"], prepared.get("image"))
    except NodeError as e:
        if e.code != "migration_unconfirmed":
            try:
                destination.migrate_abort(spec.id)
            except NodeError as e2:
                log.warning("%s: the destination could not drop the arrival: %s", spec.id, e2.message)
        raise
    figures["totalS"] = time.monotonic() - t0
    say(f"{spec.id}: moved in {figures['totalS']:.2f} s (paused {figures['pauseS']:.2f} s)")
    return figures
