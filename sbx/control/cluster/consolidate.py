"""Consolidation (issue 11): a loop that empties a lightly used node onto fuller ones, :class:`Consolidator`.

Every ``settings.consolidate_seconds`` (``SBX_CONSOLIDATE_SECONDS``, 300; 0 turns the loop off) the replica that
leads the ``consolidate`` duty (:class:`sbx.control.store.locks.LeaderLock`; on SQLite the only process) takes what
every node holds and asks :func:`sbx.control.cluster.packing.plan` what to do (the rules are in that module):

- ``drain``: the node is drained (:class:`sbx.control.cluster.drain.Drains`, reason ``consolidation``) with the plan's
  destinations: running sandboxes are live-migrated, stopped ones moved with their disk and memory image; each
  move is an event on its sandbox (``migrating``/``migrated``/``moved`` with ``reason: "consolidation"``, ``from``
  and ``to``). A drain that empties the node records ``nodes.consolidated_at``: the node stays cordoned and
  ``GET /v1/nodes`` reports it ``removable`` (``sbx node remove`` it, or ``sbx node uncordon`` it to use it again,
  which clears the mark). A drain that leaves sandboxes behind uncordons the node again (it was ready before) and
  the node is not tried again for ten periods;
- ``return``: the ready nodes are short of room and a node emptied earlier is still there: it is uncordoned;
- ``none``: nothing, and why.

Never two at once: no pass starts while any drain of this replica runs. The last pass (when, the plan with each
node's figures, the drain it started) is :meth:`Consolidator.view`, ``GET /v1/consolidation``; it lives in the
memory of the leading replica (another replica answers ``leader: false`` and no plan).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from sbx.control.cluster import capacity, packing
from sbx.control.cluster.drain import Drains
from sbx.control.cluster.packing import CONSOLIDATION_REASON, Held, NodeLoad, Plan, Rules
from sbx.control.cluster.view import ClusterView
from sbx.control.errors import ControlError
from sbx.control.store.database import iso, utcnow
from sbx.control.store.locks import LeaderLoop

log = logging.getLogger("sbx.consolidate")


class ConsolidatedPlane(ClusterView, Protocol):
    """What :class:`Consolidator` uses of its control plane (:class:`sbx.control.service.ControlPlane` is one):
    store, settings, the nodes and placement's view of them, the drains, and the nodes a live migration can't
    go to."""

    @property
    def drains(self) -> Drains: ...
    def _no_api(self) -> dict[str, str]: ...

BACKOFF_PERIODS = 10
"""Periods a node whose consolidation drain left sandboxes behind is not tried again."""


class Consolidator(LeaderLoop):
    """Runs :meth:`run_once` every ``period`` seconds (default ``settings.consolidate_seconds``; 0: never) in a
    daemon thread between :meth:`start` and :meth:`stop`, while this replica leads the ``consolidate`` duty
    (:class:`sbx.control.store.locks.LeaderLoop`; a drain it started goes on in its own thread until the server
    closes)."""

    what = "consolidation"
    pass_log = log

    def __init__(self, control: ConsolidatedPlane, period: float | None = None):
        super().__init__(control.store.engine, "consolidate",
                         control.settings.consolidate_seconds if period is None else period, join_timeout=30)
        self.cp = control
        self._guard = threading.Lock()
        self._last: dict[str, Any] | None = None
        self._drain_node: str | None = None
        self._outcome: str | None = None
        self._resting: dict[str, float] = {}
        control.drains.finishers[CONSOLIDATION_REASON] = self._drained  # also for one taken over from a dead replica

    @property
    def rules(self) -> Rules:
        s = self.cp.settings
        return Rules(s.consolidate_light_fraction, s.consolidate_headroom, s.consolidate_max_moves,
                     s.disk_reserve_gib)

    # one pass --------------------------------------------------------------------------------------------------
    def loads(self) -> list[NodeLoad]:
        """Every node this replica drives as :func:`sbx.control.cluster.packing.plan` sees it."""
        cp = self.cp
        sizes = cp.settings.sizes
        biggest = max(sizes.values(), key=lambda z: z.memory_mib)
        default = cp.router.default_name
        held: dict[str, list[Held]] = {}
        for r in cp.store.list_sandboxes():
            held.setdefault(r.node or default, []).append(
                Held(r.id, r.state, sizes.get(r.type, biggest), bool(r.has_memory)))
        no_api = cp._no_api()
        now = time.monotonic()
        out = []
        for c in cp._candidates():
            row = cp.registry.row(c.name)
            rest = self._resting.get(c.name, 0.0)
            out.append(NodeLoad(
                c.name, c.status, capacity.memory_limit_mib(cp.settings, c.host), c.committed_mib,
                c.host.disk_free_bytes, added=bool(row is not None and row.token), live=c.name not in no_api,
                fingerprint=c.fingerprint, consolidated=bool(row is not None and row.consolidated_at),
                sandboxes=tuple(held.get(c.name, ())),
                held_back=f"its last consolidation left sandboxes on it: not tried again for {rest - now:.0f} s"
                if rest > now else ""))
        return out

    def run_once(self) -> Plan:
        """Plan and act once (module docstring); returns the plan."""
        cp = self.cp
        cp.registry.refresh()
        busy = cp.drains.running()
        if busy:
            plan = Plan("none", None, f"a drain of node {busy[0]} is running")
        else:
            plan = packing.plan(self.loads(), self.rules)
        try:
            if plan.action == "drain" and plan.node is not None:
                log.info("consolidation: %s", plan.reason)
                with self._guard:
                    self._drain_node, self._outcome = plan.node, None
                cp.drains.start(plan.node, plan.moves, reason=CONSOLIDATION_REASON)
            elif plan.action == "return" and plan.node is not None:
                log.info("consolidation: %s", plan.reason)
                cp.registry.cordon(plan.node, False)
        except ControlError as e:  # the node was removed meanwhile (not_found)
            plan = Plan("none", None, f"{plan.reason}; not done: {e.message}", nodes=plan.nodes)
        with self._guard:
            changed = self._last is None or self._last["plan"]["reason"] != plan.reason
            self._last = {"at": iso(utcnow()), "plan": plan.view()}
        if changed and plan.action == "none":
            log.info("consolidation: nothing to do: %s", plan.reason)
        return plan

    def _drained(self, record: dict[str, Any]) -> None:
        """A consolidation drain has finished: mark the node emptied, or put it back to work."""
        name = record["node"]
        if record["empty"]:
            self.cp.store.set_node_consolidated(name, utcnow())
            self.cp.registry.refresh()
            outcome = f"node {name} is empty and cordoned: removable (`sbx node remove {name}`)"
        else:
            left = [i["id"] for i in record["sandboxes"] if i["status"] == "failed"]
            self.cp.registry.cordon(name, False)
            self._resting[name] = time.monotonic() + BACKOFF_PERIODS * max(self.period, 1.0)
            outcome = f"node {name} is not empty (left on it: {', '.join(left[:5]) or 'none'}): uncordoned again"
        log.info("consolidation: %s", outcome)
        with self._guard:
            self._outcome = outcome

    def view(self) -> dict[str, Any]:
        """``GET /v1/consolidation``: ``{"enabled", "periodS", "leader", "rules": {"lightFraction", "headroom",
        "maxMoves"}, "lastRunAt", "plan": {"action","node","reason","moves","nodes"}|None, "drain": the last
        consolidation drain (as ``GET /v1/nodes/{name}/drain``)|None, "outcome": what that drain ended
        with|None, "removable": [node names]}``."""
        r = self.rules
        with self._guard:
            last, node, outcome = self._last, self._drain_node, self._outcome
        drain = None
        if node is not None:
            try:
                drain = self.cp.drains.get(node)
            except ControlError:  # not_found: this replica has no record of it
                drain = None
        return {"enabled": self.period > 0, "periodS": self.period,
                "leader": self.leading or self.leader.engine is None,
                "rules": {"lightFraction": r.light_fraction, "headroom": r.headroom, "maxMoves": r.max_moves},
                "lastRunAt": last["at"] if last else None, "plan": last["plan"] if last else None,
                "drain": drain, "outcome": outcome,
                "removable": [v["name"] for v in self.cp.registry.views() if v["removable"]]}
