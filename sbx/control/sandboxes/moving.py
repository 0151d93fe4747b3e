"""Where a stopped sandbox resumes, and its move there (issue 10): :class:`MoveOps`.

A resume first asks placement (:func:`sbx.control.cluster.placement.choose_resume`) under the lifecycle lock: the
sandbox's own node when it is ready (or only cordoned, with no other node to go to) and has room, else another
ready node with room, one whose memory-image fingerprint matches first. A move runs in the resume's worker
thread: :func:`sbx.control.cluster.relocate.move_stopped`, then the row's ``node`` is pointed at the destination (the
commit point: a crash before it leaves the sandbox where it was, a crash after it leaves a copy the source's
next reconcile removes) and the source's copy is deleted. ``require_memory`` with no matching node that has room
waits up to ``settings.require_memory_wait`` seconds (120) for one (an uncordoned node, a freed one), then gives
up with ``cpu_mismatch`` and the sandbox stays stopped.
"""

from __future__ import annotations

import logging
import time

from sbx.config import Size
from sbx.control.cluster import placement
from sbx.control.cluster.relocate import move_stopped, promote_replica
from sbx.control.cluster.replicas import ReplicaRow
from sbx.control.errors import ControlError
from sbx.control.sandboxes.admission import refused
from sbx.control.sandboxes.planebase import PlaneBase
from sbx.control.store.database import SandboxRow
from sbx.node.types import NodeError

log = logging.getLogger("sbx.control")


class MoveOps(PlaneBase):
    """Resume placement and the move of a stopped sandbox between nodes."""

    def _resume_place(self, row: SandboxRow, target: Size, resize: bool, require_memory: bool
                      ) -> placement.ResumePlace | None:
        """Where ``row`` resumes at ``target`` (caller holds the lifecycle lock). None with ``require_memory``
        when no node with a matching fingerprint has room now (the worker waits for one). Raises ``507
        insufficient_capacity``."""
        what = f"resuming {row.id} as {target.name}"
        current = row.node or self.router.default_name
        cands = self._candidates(exclude=row.id)
        has_memory = row.has_memory and not resize
        src = next((c for c in cands if c.name == current), None)
        rep = self.replicas.get(row.id)
        if rep is not None and (src is None or src.status == "unreachable"):
            place = self._replica_place(rep, cands, target, what, has_memory)
            if place is not None:
                return None if require_memory and not place.memory else place
        try:
            place = placement.choose_resume(cands, self.settings, target, what, current, has_memory=has_memory)
        except ControlError as err:
            if require_memory:
                return None
            log.info("refused %s: %s", what, err.message)
            refused(err)
            raise
        if rep is not None and place.moves and place.node == rep.node:  # the replica saves the copy
            place = placement.ResumePlace(place.node, moves=True, memory=place.memory and rep.memory, replica=True)
        elif place.moves and self.archive is not None and (src is None or src.status == "unreachable"):
            arch = self.archive.current(row)
            if arch is not None:  # its node is gone: from the seal store (sbx.control.cluster.archive)
                dst = next(c for c in cands if c.name == place.node)
                memory = has_memory and arch.memory and placement.fingerprint_matches(dst.fingerprint,
                                                                                      arch.fingerprint or {})
                log.info("%s: its node is unreachable; its seal comes from the seal store to %s", what, place.node)
                place = placement.ResumePlace(place.node, moves=True, memory=memory, archive=True)
        if require_memory and not place.memory:
            return None
        return place

    def _replica_place(self, rep: ReplicaRow, cands: list[placement.Candidate], target: Size, what: str,
                       has_memory: bool) -> placement.ResumePlace | None:
        """A resume on the node holding the seal replica ``rep`` (:mod:`sbx.control.cluster.replicas`), when that node
        is ready and has room; with the memory image when it has one made on a node whose fingerprint matches."""
        dst = next((c for c in cands if c.name == rep.node), None)
        if dst is None or not placement.fits([dst], self.settings, target, what)[0]:
            return None
        memory = has_memory and rep.memory and placement.fingerprint_matches(dst.fingerprint, rep.fingerprint or {})
        log.info("%s: its node is unreachable; the seal replica on %s takes it", what, rep.node)
        return placement.ResumePlace(rep.node, moves=True, memory=memory, replica=True)

    def _wait_memory_place(self, row: SandboxRow, target: Size) -> placement.ResumePlace:
        """With ``--require-memory``: wait (up to ``settings.require_memory_wait`` s, checking every 2 s) until
        a node whose fingerprint matches has room. Raises ``NodeError("cpu_mismatch")`` when none came."""
        deadline = time.monotonic() + self.settings.require_memory_wait
        while True:
            self.registry.refresh()
            with self.lifecycle.cond:
                place = self._resume_place(row, target, False, True)
                if place is not None and place.moves:
                    self.moving_to[row.id] = (place.node, target.memory_mib)
            if place is not None:
                return place
            left = deadline - time.monotonic()
            if left <= 0:
                raise NodeError("cpu_mismatch",
                                f"no node whose CPU, kernel and CRIU match the one {row.id}'s memory image was made "
                                f"on had room within {self.settings.require_memory_wait:.0f} s; the sandbox stays "
                                "stopped (resume without --require-memory to boot it from its disk)")
            time.sleep(min(2.0, left))

    def _move(self, sandbox_id: str, src: str, dst: str, reason: str | None = None, replica: bool = False,
              archive: bool = False) -> None:
        """Move the stopped sandbox from node ``src`` to ``dst`` (module docstring); with ``replica``, ``dst``
        turns the seal replica it holds into the sandbox instead (``src`` need not answer); with ``archive``, ``dst``
        receives its seal from the seal store (``src`` need not answer). Event ``moved`` (with
        ``reason``, e.g. ``drain`` or ``consolidation``, when given; ``replica`` true when a replica was used,
        ``sealStore`` true when the seal store was).
        Raises ``NodeError``; the sandbox is then still on ``src``. A source that doesn't answer the delete of its
        copy keeps it until it does (``node_leftovers``)."""
        if replica:
            info = promote_replica(self.router.agent(dst), sandbox_id)
        elif archive and self.archive is not None and (arch := self.archive.get(sandbox_id)) is not None:
            info = self.archive.restore(self.router.agent(dst), arch)
        else:
            info = move_stopped(self.router.agent(src), self.router.agent(dst), sandbox_id)
        self.store.update_sandbox(sandbox_id, node=dst)
        self.replicas.forget(sandbox_id)
        self.secrets.nodes.reapply(sandbox_id)  # before its resume there: the boot applies the redirect
        log.info("moved %s from %s to %s: %d bytes in %d files (%s disk delta, memory %s) in %.2f s", sandbox_id,
                 src, dst, info["bytes"], info["files"], info["delta"], info["memory"], info["seconds"])
        self.add_event(sandbox_id, {"event": "moved", "id": sandbox_id, "from": src, "to": dst,
                                    "bytes": info["bytes"], "memory": info["memory"],
                                    **({"reason": reason} if reason else {}), **({"replica": True} if replica else {}),
                                    **({"sealStore": True} if archive else {})})
        try:
            self.router.agent(src).delete(sandbox_id)
        except NodeError as e:  # the replicator deletes it once that node answers again
            log.warning("the old copy of %s on %s stays for now: %s", sandbox_id, src, e.message)
            self.replicas.add_leftover(sandbox_id, src)
