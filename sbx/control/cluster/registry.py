"""The node registry (issue 10): which node agents a server uses, whether they answer, what they hold.

A server heartbeats each node it drives (its configured one and the added ones, :mod:`sbx.control.cluster.router`)
every ``settings.node_heartbeat_seconds`` (2 s): it asks the node for its
:class:`sbx.node.types.NodeInfo` (capacity, load, memory-image fingerprint) and records the answer in the store's
``nodes`` table (the first answer registers the node). Every replica on a shared database does the same for the
nodes it uses, and reads the others' rows, so ``sbx node list`` shows all of them.

A node's status:

- ``unreachable``: no heartbeat answered for ``settings.node_unreachable_seconds`` (6 s): its sandboxes keep their
  ``state`` and show ``nodeStatus: "unreachable"`` until it answers again;
- ``cordoned``: it answers, but no new sandbox is placed there (``sbx node cordon NODE``); its sandboxes run on;
- ``ready``: otherwise.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from sbx.config import Settings
from sbx.control.cluster.capacity import promised_disk_bytes
from sbx.control.errors import ControlError
from sbx.control.store.database import NodeRow, Store, as_utc, iso, utcnow
from sbx.node.types import NodeAgent, NodeError

if TYPE_CHECKING:
    from sbx.control.cluster.router import NodeRouter

log = logging.getLogger("sbx.control")

NODE_STATUSES = ("ready", "cordoned", "unreachable")


class NodeRegistry:
    """Heartbeats of ``node`` (reached at ``url``; ``local`` for the embedded node) into ``store``, and the status
    of every registered node. Thread-safe; :meth:`start` runs the heartbeat thread, :meth:`stop` ends it."""

    def __init__(self, store: Store, settings: Settings, node: NodeAgent, url: str = "local",
                 router: NodeRouter | None = None):
        self.store = store
        self.settings = settings
        self.node = node
        self.url = url
        self.router = router
        self.name: str = settings.node_name  # replaced by the name the node reports in its first heartbeat
        self._rows: dict[str, NodeRow] = {}
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # heartbeats ------------------------------------------------------------------------------------------------
    def beat(self) -> bool:
        """One heartbeat of every node (at once, so a node that doesn't answer delays no other): ask it, record its
        answer, reload every row. True when the configured node answered."""
        answered = False
        try:
            info = self.node.info()
            self.name = info.name
            if self.router is not None:
                self.router.default_name = info.name
            self.store.heartbeat_node(info.name, self.url, asdict(info))
            answered = True
        except NodeError as e:
            log.debug("heartbeat of %s failed: %s", self.name, e.message)
        if self.router is not None:
            self.router.refresh()
            others = [(n, url, a) for n, (url, a) in self.router.agents().items() if n != self.name]
            if others:
                with ThreadPoolExecutor(max_workers=len(others), thread_name_prefix="sbx-beat") as pool:
                    list(pool.map(lambda t: self._beat_added(*t), others))
        self.refresh()
        return answered

    def _beat_added(self, name: str, url: str, agent: NodeAgent) -> None:
        try:
            info = agent.info()
        except NodeError as e:
            log.debug("heartbeat of %s failed: %s", name, e.message)
            return
        if info.name != name:
            log.warning("the node at %s now calls itself %s, not %s: not recorded", url, info.name, name)
            return
        self.store.heartbeat_node(name, url, asdict(info))

    def refresh(self) -> None:
        """Reload the registered nodes from the store (other replicas' heartbeats and cordons)."""
        rows = {r.name: r for r in self.store.list_nodes()}
        with self._guard:
            self._rows = rows

    def start(self) -> None:
        """Beat once now, then every ``settings.node_heartbeat_seconds`` in a thread."""
        self.beat()
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(self.settings.node_heartbeat_seconds):
                try:
                    self.beat()
                except Exception:  # the store went away for a moment: try again at the next beat
                    log.exception("node heartbeat failed")

        self._thread = threading.Thread(target=loop, name="sbx-node-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the heartbeat thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # status ----------------------------------------------------------------------------------------------------
    def _status(self, row: NodeRow | None) -> str:
        if row is None or row.last_seen is None:
            return "unreachable"
        age = (utcnow() - as_utc(row.last_seen)).total_seconds()
        if age > self.settings.node_unreachable_seconds:
            return "unreachable"
        return "cordoned" if row.cordoned else "ready"

    def status(self, name: str | None) -> str:
        """``ready``, ``cordoned`` or ``unreachable`` for node ``name`` (None: this server's node)."""
        with self._guard:
            row = self._rows.get(name or self.name)
        return self._status(row)

    def view(self, row: NodeRow) -> dict[str, Any]:
        """The API shape of a node: ``{"name","url","status","cordoned","removable","consolidatedAt","lastSeen",
        "registeredAt","sandboxes","capacity": {"memoryMiB","diskFreeBytes","diskPromisedBytes","vcpus"}, "load":
        {"load1","running"},
        "fingerprint": {...}, "egress"}`` (``sandboxes``: how many not-deleted sandboxes it holds, by the store;
        ``removable``: an added node that is cordoned and holds none, so ``sbx node remove`` takes it;
        ``consolidatedAt``: when consolidation emptied it, :mod:`sbx.control.cluster.consolidate`;
        ``diskPromisedBytes``: the disk sizes of those sandboxes together, what their sparse disks may grow to
        against ``diskFreeBytes``, :func:`sbx.control.cluster.capacity.promised_disk_bytes`)."""
        info = row.info or {}
        held = [s for s in self.store.list_sandboxes() if (s.node or self.name) == row.name]
        count = len(held)
        promised = promised_disk_bytes(held, self.settings)
        return {
            "name": row.name,
            "url": row.url,
            "status": self._status(row),
            "cordoned": bool(row.cordoned),
            "removable": bool(row.cordoned) and count == 0 and bool(row.token),
            "consolidatedAt": iso(row.consolidated_at),
            "lastSeen": iso(row.last_seen),
            "registeredAt": iso(row.registered_at),
            "sandboxes": count,
            "capacity": {"memoryMiB": int(info.get("memory_mib", 0)),
                         "diskFreeBytes": int(info.get("disk_free_bytes", 0)), "diskPromisedBytes": promised,
                         "vcpus": int(info.get("vcpus", 0))},
            "load": {"load1": float(info.get("load1", 0.0)), "running": int(info.get("running", 0))},
            "fingerprint": {str(k): str(v) for k, v in (info.get("fingerprint") or {}).items()},
            "egress": bool(info.get("egress", False)),
        }

    def views(self) -> list[dict[str, Any]]:
        """Every registered node (:meth:`view`), by name."""
        self.refresh()
        with self._guard:
            rows = list(self._rows.values())
        return [self.view(r) for r in sorted(rows, key=lambda r: r.name)]

    def cordon(self, name: str, cordoned: bool) -> dict[str, Any]:
        """Cordon (``True``) or uncordon node ``name``; its view. Raises 404 ``not_found`` for an unknown node."""
        try:
            row = self.store.set_node_cordoned(name, cordoned)
        except KeyError:
            raise ControlError("not_found", f"no node {name!r} (see `sbx node list`)", 404) from None
        self.refresh()
        return self.view(row)

    def row(self, name: str) -> NodeRow | None:
        """The registry row of node ``name`` as last loaded (None for an unknown node)."""
        with self._guard:
            return self._rows.get(name)
