"""A fork whose source's node is full (issue 10 item 4): :class:`ForkOps`, the fork placed and made elsewhere.

``fork`` (:meth:`sbx.control.sandboxes.operations.LifecycleOps.fork`) asks placement
(:func:`sbx.control.cluster.placement.choose_fork`) under the lifecycle lock. When the source's node may take the fork,
nothing changes: the node reflinks the source's disk and boots (or restores) the copy there, in constant time. When that
node is full or cordoned, another ready node with room takes it (with ``--memory`` only one whose memory-image
fingerprint matches the source node's: the fork promises the processes, so it is refused with 507 rather than booted
cold), and the fork's row names that node from the start (its memory is counted there, so no other start takes the room
meanwhile). Then, in the fork's worker:

1. ``provisioning``: the source's node makes the fork as a *stopped* sandbox without starting it
   (:meth:`sbx.node.lifecycle.snapshots.SnapshotMixin.fork_stopped`): its disk reflinked from the source's (a running
   source's filesystem frozen for the copy), with ``--memory`` also the source's memory dumped with
   ``--leave-running`` while it is paused, as a fork with memory on one node does; the source's hold ends here;
2. the stopped fork moves to the destination as any stopped sandbox does
   (:func:`sbx.control.cluster.relocate.move_stopped`: the disk as a delta with only the blocks the destination lacks
   against its base image, the memory image, each file hash-checked), and the source node's copy is deleted; event
   ``moved`` (``from``, ``to``, ``bytes``, ``memory``);
3. the destination starts it (:meth:`sbx.node.types.NodeAgent.resume`): a cold boot with the fork's new identity,
   or with ``--memory`` a restore that must succeed (``require_memory``) and then gets the new identity as a
   fork with memory does (new SSH host keys, sshd restarted); ``running``.

A failure in 1 or 2 deletes whatever the source's node holds of the fork (the move itself leaves nothing on the
destination) and the fork's row ends ``error`` with the node's code, as a failed fork on one node does; a
failure in 3 leaves the fork's disk where its row points (``sbx delete`` removes it). The source is never
touched but for the pause of step 1.

Crash safety: a server killed during 1 or 2 leaves a ``provisioning`` row whose node (the destination) has nothing:
it settles to ``error``/``interrupted``, and the copy on the source's node is removed by that node's reconcile
(the store doesn't put the fork there) or, with replicas, when the row is settled
(:meth:`ForkOps._settle_fork_copy`). Killed after the move, the row settles to ``stopped`` on the destination; its
first resume gives it its new identity (the node record keeps ``freshIdentity`` until a start wrote it).
"""

from __future__ import annotations

import logging
from typing import Any, cast

from sbx.config import Size
from sbx.control.cluster import placement
from sbx.control.cluster.relocate import move_stopped
from sbx.control.errors import ControlError
from sbx.control.sandboxes.admission import refused
from sbx.control.sandboxes.migrating import MigrateOps
from sbx.control.store.database import SandboxRow
from sbx.node.types import NodeError, SandboxSpec

log = logging.getLogger("sbx.control")


class ForkOps(MigrateOps):
    """Fork placement, and a fork made on its source's node and moved to another (module docstring)."""

    def _fork_place(self, size: Size, what: str, home: str, memory: bool) -> placement.ResumePlace:
        """Where ``what`` (a fork at ``size`` of a sandbox on node ``home``) goes (caller holds the lifecycle
        lock). Raises ``507 insufficient_capacity`` naming each node's reason."""
        try:
            return placement.choose_fork(self._candidates(), self.settings, size, what, home, memory)
        except ControlError as err:
            log.info("refused %s: %s", what, err.message)
            refused(err)
            raise

    def _fork_elsewhere(self, fork_id: str, source_id: str, home: str, dst: str, spec: SandboxSpec,
                        memory: bool) -> None:
        """Steps 1-3 of the module docstring, in the fork's worker (the caller holds the source's hold; it ends
        here after step 1). Raises ``NodeError`` (the row then goes ``error``)."""
        # a node agent with the transfer calls (sbx.node.migration.transfer)
        src_agent = cast(Any, self.router.agent(home))
        try:
            self.lifecycle.transition(fork_id, "provisioning")
            src_agent.fork_stopped(source_id, spec, memory=memory)
        finally:
            self.lifecycle.release_hold(source_id)
        try:
            info = move_stopped(src_agent, self.router.agent(dst), fork_id)
        except BaseException:
            self._drop_fork_copy(fork_id, home)
            raise
        self._drop_fork_copy(fork_id, home)
        log.info("fork %s of %s made on %s and moved to %s: %d bytes in %d files (%s disk delta, memory %s) in "
                 "%.2f s", fork_id, source_id, home, dst, info["bytes"], info["files"], info["delta"],
                 info["memory"], info["seconds"])
        self.add_event(fork_id, {"event": "moved", "id": fork_id, "from": home, "to": dst,
                                 "bytes": info["bytes"], "memory": info["memory"]})
        self.node.resume(fork_id, spec, require_memory=memory)  # the row's node: the destination
        self.activity.touch(fork_id)
        if memory:
            self.lifecycle.transition(fork_id, "running", memory_restored=True)
        else:
            self.lifecycle.transition(fork_id, "running")

    def _drop_fork_copy(self, fork_id: str, node: str) -> None:
        """Delete what node ``node`` holds of fork ``fork_id`` (its row points elsewhere); a node that fails to
        is left to its next reconcile, which removes what the store doesn't put there."""
        try:
            self.router.agent(node).delete(fork_id)
        except NodeError as e:
            log.warning("the copy of fork %s on %s stays until that node reconciles: %s", fork_id, node, e.message)

    def _settle_fork_copy(self, row: SandboxRow) -> None:
        """For a fork row cut short by a crash (``forking``/``provisioning``): a copy of it on its source's node,
        when that is not the node its row names, is one made to move (module docstring); delete it."""
        if row.state not in ("forking", "provisioning") or row.source_id is None:
            return
        source = self.store.get_sandbox(row.source_id)
        home = (source.node if source is not None else None) or self.router.default_name
        if home == (row.node or self.router.default_name) or home not in self.router.agents():
            return
        try:
            if self.router.agent(home).status(row.id) != "absent":
                log.warning("fork %s was cut short while made on %s for another node: removing that copy",
                            row.id, home)
                self._drop_fork_copy(row.id, home)
        except NodeError as e:
            log.info("node %s did not say whether it holds a copy of fork %s: %s", home, row.id, e.message)
