"""Noticing running sandboxes whose init ended on its own: :class:`WatchMixin`.

The watcher thread (:mod:`sbx.node.container.watch`) runs a pass about once a second: OOM kills in child cgroups are
counted, and a sandbox whose init is gone is settled (container, veth and cgroups removed, disk unmounted and
sealed, phase ``stopped`` with the reason: power-off, reboot or crash) and reported through ``on_exit``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from sbx.node.agentbase import NodeBase
from sbx.node.container import cgroup, guestfs, watch
from sbx.node.types import NodeError

log = logging.getLogger("sbx.node")


class WatchMixin(NodeBase):
    """The exit watcher (part of :class:`sbx.node.agent.LocalNode`)."""

    def _write_shutdown_hook(self, sid: str) -> None:
        """Install the guest's shutdown hook (it tells a reboot from a power-off) and clear the last word."""
        root = self._hostroot(sid)  # host writes go through the plain mount (EOVERFLOW through the idmapped one)
        guestfs.write_file(root, watch.HOOK_PATH, watch.HOOK_SCRIPT.encode(), mode=0o755)
        guestfs.write_file(root, watch.KIND_FILE, b"")

    def watch(self, on_exit: Callable[[str, str, str | None], None]) -> None:
        """Start noticing running sandboxes whose init ended on its own (checked about once a second, see
        :mod:`sbx.node.container.watch`). For each, the node removes the container, its veth and cgroups, unmounts the
        disk (kept, no memory image) and calls ``on_exit(id, kind, detail)`` with ``kind`` ``"poweroff"`` (power-off or
        halt inside), ``"reboot"`` (reboot inside: the caller should boot it again) or ``"crashed"`` (init killed or
        died; ``detail`` says so). Idempotent; :meth:`unwatch` stops it."""
        self._on_exit = on_exit
        if self._watcher is None:
            self._kernel_ooms.open()
            self._watcher = watch.Watcher(self._watch_pass)
            self._watcher.start()

    def unwatch(self) -> None:
        """Stop the watcher thread (at shutdown)."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
            self._kernel_ooms.close()

    def _count_nested_ooms(self) -> None:
        """Add OOM kills the kernel logged in a sandbox's child cgroups (its own cgroup's kills are in its
        ``memory.oom_control`` counter already) to the sandbox's count, saved in ``node.json`` (``oomKillsNested``)
        as soon as no operation holds the sandbox."""
        prefix = f"/sbx/{self.settings.node_name}/"
        for memcg in self._kernel_ooms.read():
            if memcg.startswith(prefix):
                sid, _, below = memcg.removeprefix(prefix).partition("/")
                if below:
                    self._nested_ooms[sid] = self._nested_ooms.get(sid, 0) + 1
        for sid, n in list(self._nested_ooms.items()):
            lock = self._lock(sid)
            if not lock.acquire(blocking=False):
                continue
            try:
                rec = self._record(sid)
                rec["oomKillsNested"] = rec.get("oomKillsNested", 0) + n
                self._save(sid, rec)
            except NodeError:
                pass
            finally:
                lock.release()
            self._nested_ooms.pop(sid, None)

    def _watch_pass(self) -> None:
        if not self.sandboxes_dir.is_dir():
            return
        self._count_nested_ooms()
        for d in sorted(self.sandboxes_dir.iterdir()):
            try:
                if json.loads((d / "node.json").read_text()).get("phase") != "running":
                    continue
            except (OSError, ValueError):
                continue
            if self._init_alive(d.name):
                continue
            lock = self._lock(d.name)
            if not lock.acquire(blocking=False):  # an operation is working on it: it decides
                continue
            try:
                ended = self._settle_ended(d.name)
            finally:
                lock.release()
            if ended is not None and self._on_exit is not None:
                self._on_exit(d.name, *ended)

    def _init_alive(self, sid: str) -> bool:
        """Whether the sandbox's init lives: runc's state file's init (no runc started), or for a gvisor sandbox
        runsc's state file's Sandbox process (:meth:`sbx.runtime.runsc.RunscRuntime.state`)."""
        if self.runtime.gvisor(sid):
            return self.runtime.state(sid) in ("running", "paused", "created")
        return bool(watch.init_alive(self.run_dir / "runc" / sid / "state.json"))

    def _settle_ended(self, sid: str) -> tuple[str, str | None] | None:
        """With the sandbox's lock held: if its init really ended, clean up and return ``(kind, detail)``."""
        try:
            rec = self._record(sid)
        except NodeError:
            return None
        if rec.get("phase") != "running" or self._init_alive(sid):
            return None
        try:
            word = guestfs.read_file(self._hostroot(sid), watch.KIND_FILE, limit=64).decode(errors="replace")
        except (OSError, guestfs.UnsafePath):
            word = ""
        kind = watch.exit_kind(word)
        detail = None if kind != "crashed" else "the sandbox's init ended without a shutdown (killed or crashed)"
        log.warning("%s ended on its own: %s", sid, kind)
        rec["oomKills"] = rec.get("oomKills", 0) + cgroup.oom_kills(self._cgroup_path(sid))
        rec["phase"] = "stopping"
        rec["haltBegun"] = True
        rec["diskGen"] = int(rec.get("diskGen", 0)) + 1
        self._save(sid, rec)
        self._cleanup_container(sid)
        self._umount(sid)
        self._discard_memory(sid)
        self._seal(sid)
        self._set_phase(sid, "stopped", stopReason=kind, lastError=detail)
        return kind, detail
