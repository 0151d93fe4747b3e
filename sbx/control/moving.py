"""Where a stopped sandbox resumes, and its move there (issue 10): :class:`MoveOps`.

A resume first asks placement (:func:`sbx.control.placement.choose_resume`) under the lifecycle lock: the
sandbox's own node when it is ready (or only cordoned, with no other node to go to) and has room, else another
ready node with room, one whose memory-image fingerprint matches first. A move runs in the resume's worker
thread: :func:`sbx.control.relocate.move_stopped`, then the row's ``node`` is pointed at the destination (the
commit point: a crash before it leaves the sandbox where it was, a crash after it leaves a copy the source's
next reconcile removes) and the source's copy is deleted. ``require_memory`` with no matching node that has room
waits up to ``settings.require_memory_wait`` seconds (120) for one (an uncordoned node, a freed one), then gives
up with ``cpu_mismatch`` and the sandbox stays stopped.
"""

from __future__ import annotations

import logging
import time

from sbx.config import Size
from sbx.control import placement
from sbx.control.errors import ControlError
from sbx.control.planebase import PlaneBase
from sbx.control.relocate import move_stopped
from sbx.control.store import SandboxRow
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
        try:
            place = placement.choose_resume(self._candidates(exclude=row.id), self.settings, target, what, current,
                                            has_memory=row.has_memory and not resize)
        except ControlError as err:
            if require_memory:
                return None
            log.info("refused %s: %s", what, err.message)
            raise
        if require_memory and not place.memory:
            return None
        return place

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

    def _move(self, sandbox_id: str, src: str, dst: str, reason: str | None = None) -> None:
        """Move the stopped sandbox from node ``src`` to ``dst`` (module docstring); event ``moved`` (with
        ``reason``, e.g. ``drain`` or ``consolidation``, when given). Raises ``NodeError``; the sandbox is then
        still on ``src``."""
        info = move_stopped(self.router.agent(src), self.router.agent(dst), sandbox_id)
        self.store.update_sandbox(sandbox_id, node=dst)
        self.secrets.nodes.reapply(sandbox_id)  # before its resume there: the boot applies the redirect
        log.info("moved %s from %s to %s: %d bytes in %d files (%s disk delta, memory %s) in %.2f s", sandbox_id,
                 src, dst, info["bytes"], info["files"], info["delta"], info["memory"], info["seconds"])
        self.add_event(sandbox_id, {"event": "moved", "id": sandbox_id, "from": src, "to": dst,
                                    "bytes": info["bytes"], "memory": info["memory"],
                                    **({"reason": reason} if reason else {})})
        try:
            self.router.agent(src).delete(sandbox_id)
        except NodeError as e:  # its next reconcile removes it: the store no longer puts it there
            log.warning("the old copy of %s on %s stays for now: %s", sandbox_id, src, e.message)
