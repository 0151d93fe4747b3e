"""Putting the node back in order: :class:`ReconcileMixin`.

Reconcile after a (possibly crashed) start: thaw frozen roots, kill orphaned runc commands and execs, remove what
the control plane doesn't know, finish or undo interrupted operations. Also the server's shutdown: ending
attached execs, and removing the node's host state (bridge, nftables, ``/run/sbx/<node>``, cgroups) afterwards.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from sbx.node.agentbase import NodeBase
from sbx.node.container import cgroup, recovery
from sbx.node.network import bridge as network
from sbx.node.types import NodeError, NodeStatus
from sbx.runtime.runc import kill_process_group, remove_tree
from sbx.storage import disk as disks

log = logging.getLogger("sbx.node")


class ReconcileMixin(NodeBase):
    """Reconcile, server shutdown and leftovers (part of :class:`sbx.node.agent.LocalNode`)."""

    def reconcile(self, known: dict[str, str]) -> dict[str, NodeStatus]:
        """Bring every sandbox on this node to a consistent state after a (possibly crashed) start:

        - containers, mounts, veths and sandbox folders of ids the control plane doesn't know are removed;
        - runc commands a dead node process left running (a checkpoint, say) are killed first;
        - a stop the crash interrupted is finished: if CRIU had not started yet (no ``dump.log``) the container
          is intact and is checkpointed again; if it had, the container is not trusted (a CRIU killed while its
          parasite code runs in the tasks leaves them damaged: measured, they die moments later) and is killed;
        - an arrival from another node that was never confirmed (phase ``incoming``) is removed; a sandbox this
          node was moving away is thawed and runs on here, or, when the handover had begun, settled by asking
          the destination (:mod:`sbx.node.migration.outgoing`);
        - a known sandbox whose container still runs (and no stop was interrupted) stays running: it survived the
          server restart, and a volume of it that is no longer mounted is mounted again; one restored from a
          template whose new SSH host keys and sshd were still to come (``identityPending``) gets them now;
        - otherwise any half-made container is removed, the disk unmounted, and the sandbox is ``checkpointed``
          when a complete memory image (with ``host.json``) exists, else ``stopped`` (disk only).
        """
        result: dict[str, NodeStatus] = {}
        # warm sandboxes are a cache (sbx.node.memory.warmpool); those of a dead process are unknown
        self._pool_forget()
        self._thaw_all()  # first: a frozen root blocks CRIU, unmounts and the container's own shutdown
        # A node that died mid-operation leaves its runc commands running (they have sessions of their own):
        # stop them before looking at what they were working on.
        if self.runtime.kill_orphans():
            time.sleep(0.2)
        self._kill_leftover_execs()
        for cid in self.runtime.list():
            if cid not in known:
                self.runtime.delete(cid)
        if self.sandboxes_dir.is_dir():
            for d in self.sandboxes_dir.iterdir():
                if d.name not in known:  # also a memory template's build interrupted by a crash
                    self.delete(d.name)
        self._reconcile_templates()
        for veth in network.host_veths("v"):
            sid = "sb_" + veth[1:]
            if sid not in known and self._owns_veth(veth):
                network.unwire_sandbox(network.Lease("", "", veth))
        for sid in known:
            with self._lock(sid):
                if not (self._dir(sid) / "node.json").is_file():
                    result[sid] = "absent"
                    continue
                rec = self._record(sid)
                if rec.get("phase") == "incoming":  # an arrival never confirmed: its source keeps the sandbox
                    log.warning("%s: removing an arrival from another node that was not confirmed", sid)
                    self.delete(sid)
                    result[sid] = "absent"
                    continue
                if rec.get("phase") in ("migrating", "handover"):
                    settled = self._reconcile_migration(sid, rec)
                    result[sid] = "running" if settled is None else settled  # type: ignore[assignment]
                    continue
                if self._half_made(sid, rec):
                    log.warning("%s was interrupted before its disk was complete: removing it", sid)
                    self.delete(sid)
                    result[sid] = "absent"
                    continue
                state = self.runtime.state(sid)
                if state == "paused":  # frozen by a stop before its dump or a fork with memory, then the node died
                    cgroup.thaw(self._cgroup_path(sid))
                    state = self.runtime.state(sid)
                running = state == "running"
                if rec["phase"] == "stopping":
                    untouched = not (self._dir(sid) / "criu-work" / "dump.log").exists()
                    if running and untouched:
                        keep = rec.get("stopKeepMemory", True) and not rec.get("haltBegun", False)
                        saved = self.stop(sid, keep_memory=keep).memory_saved
                        result[sid] = "checkpointed" if saved else "stopped"
                        continue
                elif running:
                    self._discard_memory(sid)  # whatever image is left, the disk has moved on since
                    self._set_phase(sid, "running")
                    if rec.get("identityPending"):  # restored from a template; its identity thread never ran
                        self._finish_identity(sid)
                    try:  # a volume whose JuiceFS daemon died with the node is mounted again (sbx.node.volumes)
                        self._attach_volumes(sid)
                    except NodeError as e:
                        log.warning("%s: its volumes could not be mounted again: %s", sid, e.message)
                    result[sid] = "running"
                    continue
                self._detach_volumes(sid)
                self._cleanup_container(sid)
                self._umount(sid)
                mem_ok = self._memory_usable(sid)
                if not mem_ok:
                    self._discard_memory(sid)
                self._set_phase(sid, "checkpointed" if mem_ok else "stopped")
                result[sid] = "checkpointed" if mem_ok else "stopped"
        live = [self._lease(sid) for sid, st in result.items() if st == "running"]
        network.sync_pins(self.settings.bridge, self.settings.node_name, live)
        return result

    def recorded(self) -> dict[str, str]:
        """``{id: phase}`` of every sandbox folder on this node (``"unknown"`` without a readable record): what a
        node agent restarted on its own passes to :meth:`reconcile`, so it removes only what no record names."""
        out: dict[str, str] = {}
        for d in sorted(self.sandboxes_dir.iterdir()) if self.sandboxes_dir.is_dir() else []:
            try:
                rec = json.loads((d / "node.json").read_text())
            except (OSError, ValueError):
                out[d.name] = "unknown"
                continue
            if not rec.get("pooled"):  # a warm sandbox is nobody's: the reconcile removes it as unknown
                out[d.name] = str(rec.get("phase", "unknown"))
        return out

    def _thaw_all(self) -> None:
        """Thaw every mounted sandbox root and any recorded ``freezing`` mount point ("not frozen" is ignored),
        drop the ``freezing`` intents, and remove half-written snapshot copies (``snapshots/*.tmp``)."""
        if not self.sandboxes_dir.is_dir():
            return
        for d in self.sandboxes_dir.iterdir():
            points: set[str] = set()
            mp = disks.mounted_at(d / "disk.ext4")
            if mp is not None:
                points.add(str(mp))
            try:
                rec = json.loads((d / "node.json").read_text())
            except (OSError, ValueError):
                rec = None
            if rec and rec.get("freezing"):
                points.add(str(rec["freezing"]))
            for point in sorted(points):
                if recovery.thaw(point):
                    log.warning("%s: thawed its root filesystem at %s (left frozen by a crash)", d.name, point)
            if rec and "freezing" in rec:
                rec.pop("freezing")
                self._save(d.name, rec)
        for tmp in self.snapshots_dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)

    def _half_made(self, sid: str, rec: dict[str, Any]) -> bool:
        """True for a sandbox whose disk was never completed: a create or fork interrupted while its record was
        still ``creating``, or any record whose disk is missing."""
        return rec.get("phase") == "creating" or not self._disk(sid).is_file()

    def _owns_veth(self, veth: str) -> bool:
        """True if ``veth`` is a port of this node's bridge (so another node's sandboxes are left alone). Asked over
        netlink, not ``/sys/class/net``: a node agent in a network namespace of its own (``nsenter --net``) still
        sees the host's sysfs."""
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            bridge = ipr.link_lookup(ifname=self.settings.bridge)
            port = ipr.link_lookup(ifname=veth)
            if not bridge or not port:
                return False
            return bool(ipr.get_links(port[0])[0].get_attr("IFLA_MASTER") == bridge[0])

    def begin_shutdown(self, grace: float) -> None:
        """The server is going away: attached execs still running after ``grace`` seconds are killed and their
        streams end with ``NodeError("server_shutdown")`` (the API sends it as the stream's error line). Warm
        sandboxes (:mod:`sbx.node.memory.warmpool`) are deleted: nobody owns them, and none is made any more."""
        self._shutdown_at = time.monotonic() + grace
        self._pool_forget()

    def cleanup_host(self) -> bool:
        """After the server stopped: when no sandbox container of this node runs any more, remove the bridge,
        the node's nftables table, ``/run/sbx/<node>`` and the node's cgroup folders. Returns True when it did
        (with sandboxes still running, everything stays: they need it)."""
        if any(self.runtime.state(cid) == "running" for cid in self.runtime.list()):
            return False
        network.remove_bridge(self.settings.bridge, self.settings.node_name)
        for d in self.sandboxes_dir.glob("*") if self.sandboxes_dir.is_dir() else []:
            self._umount(d.name, wait=5.0)
        cgroup.remove_tree(f"/sbx/{self.settings.node_name}")
        remove_tree(self.run_dir)  # lazily unmounts what it meets: the node's mask filesystem (sbx.runtime.oci)
        return True

    def _kill_leftover_execs(self) -> None:
        """Kill commands that attached execs of a killed server left running (their ``exec-*.pid`` files are
        still in the bundles): nobody can read their output any more. A pid is killed only while it is still in
        that sandbox's cgroup (never a reused pid)."""
        for pid_file in (self.run_dir / "bundles").glob("*/exec-*.pid"):
            sid = pid_file.parent.name
            try:
                pid = int(pid_file.read_text().strip())
                in_sandbox = self._cgroup_path(sid) in Path(f"/proc/{pid}/cgroup").read_text()
            except (OSError, ValueError):
                in_sandbox = False
            if in_sandbox:
                log.warning("%s: killing exec pid %d left running by a killed server", sid, pid)
                kill_process_group(pid_file)
            pid_file.unlink(missing_ok=True)
