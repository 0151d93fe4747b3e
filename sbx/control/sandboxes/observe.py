"""What the control plane tells ``/metrics`` (issue 35; the series are :mod:`sbx.metrics`): :class:`OpTimer`, a
state hook that times each lifecycle operation from the request that began it to the state it settles in, and
:class:`PlaneCollector`, the gauges a scrape computes from the store and the node registry at that moment.

Neither puts a sandbox id, an account or a key in a label: the series are aggregates over the installation.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy.orm import Session

from sbx import metrics
from sbx.config import Settings
from sbx.control.cluster import capacity
from sbx.control.cluster.placement import Candidate
from sbx.control.cluster.replicas import ReplicaBook
from sbx.control.cluster.router import NodeRouter
from sbx.control.cluster.trim import Trimmer
from sbx.control.store.database import SandboxRow, Store, utcnow
from sbx.control.store.state import STATES, TRANSIENT

log = logging.getLogger("sbx.control")

OPERATION_OF_STATE = {"provisioning": "create", "forking": "fork", "stopping": "stop", "resuming": "resume",
                      "deleting": "delete", "migrating": "migrate"}
"""The operation a sandbox is in while in each transient state (the state it enters first: a fork goes on through
``provisioning`` and stays a fork)."""


class OpTimer:
    """A state hook (:attr:`sbx.control.store.database.Store.state_hooks`): a sandbox entering a transient state
    from a stable one (or created in one) starts its operation's clock; reaching a stable state observes
    ``sbx_operation_seconds{op,outcome}`` (``error`` when the row ends in ``error`` or carries an error code, as a
    resume refused by its node does) and logs the figure. Only this process's transitions are seen: an operation
    begun by one replica and settled by another is not timed."""

    def __init__(self, clock: Any = time.monotonic):
        self._clock = clock
        self._started: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def on_state(self, _s: Session | None, row: SandboxRow, old: str, _when: dt.datetime | None) -> None:
        """The hook: start or end the clock of ``row``'s operation as it moves from ``old`` to ``row.state``."""
        if row.state in TRANSIENT:
            if old not in TRANSIENT:
                with self._lock:
                    self._started[row.id] = (OPERATION_OF_STATE[row.state], self._clock())
            return
        with self._lock:
            began = self._started.pop(row.id, None)
        if began is None:
            return
        op, t0 = began
        seconds = max(0.0, self._clock() - t0)
        outcome = "error" if row.state == "error" or row.error_code else "ok"
        metrics.OPERATION_SECONDS.labels(op=op, outcome=outcome).observe(seconds)
        log.info("%s of %s: %s after %.3f s", op, row.id, row.state if outcome == "ok" else "failed", seconds,
                 extra={"sandboxId": row.id})

    def in_flight(self) -> int:
        """Operations whose clock runs now."""
        with self._lock:
            return len(self._started)


class ObservedPlane(Protocol):
    """What :class:`PlaneCollector` reads of the control plane (:class:`sbx.control.service.ControlPlane` is one)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def store(self) -> Store: ...
    @property
    def router(self) -> NodeRouter: ...
    @property
    def replicas(self) -> ReplicaBook: ...
    @property
    def trimmer(self) -> Trimmer: ...
    def _candidates(self, exclude: str | None = None) -> list[Candidate]: ...


class PlaneCollector:
    """A prometheus-client collector (rendered by :func:`sbx.metrics.render`, registered nowhere) whose
    :meth:`collect` reads the store and the registry at scrape time."""

    def __init__(self, plane: ObservedPlane):
        self.plane = plane

    def collect(self) -> Iterator[Any]:
        """``sbx_sandboxes{state}`` (every state, 0 included; deleted ones are not counted), the capacity of each
        node placement sees, the seal replicas still to make and the volume trims done."""
        p = self.plane
        rows = p.store.list_sandboxes()
        yield self._states(rows)
        yield from self._nodes(p._candidates())
        yield from self._replication(rows)
        trims = CounterMetricFamily("sbx_trim_passes", "Trims of the data volume this server ran.")
        trims.add_metric([], p.trimmer.passes)
        yield trims

    @staticmethod
    def _states(rows: list[SandboxRow]) -> GaugeMetricFamily:
        counts = dict.fromkeys((s for s in STATES if s != "deleted"), 0)
        for r in rows:
            counts[r.state] = counts.get(r.state, 0) + 1
        g = GaugeMetricFamily("sbx_sandboxes", "Sandboxes in each state (deleted ones not counted).",
                              labels=["state"])
        for state, n in sorted(counts.items()):
            g.add_metric([state], n)
        return g

    def _nodes(self, cands: list[Candidate]) -> Iterator[GaugeMetricFamily]:
        settings = self.plane.settings
        mem = GaugeMetricFamily("sbx_node_memory_bytes", "RAM of each node.", labels=["node"])
        limit = GaugeMetricFamily("sbx_node_memory_limit_bytes", "Memory limits each node may promise in all "
                                  "(its RAM less the reserve, times the overcommit).", labels=["node"])
        reserved = GaugeMetricFamily("sbx_node_memory_reserved_bytes", "Memory limits promised to the sandboxes on "
                                     "each node that hold memory (and moves on their way there).", labels=["node"])
        disk = GaugeMetricFamily("sbx_node_disk_free_bytes", "Room left on each node's data volume.",
                                 labels=["node"])
        up = GaugeMetricFamily("sbx_node_up", "1 for each node with its status (ready, cordoned, unreachable).",
                               labels=["node", "status"])
        for c in cands:
            mem.add_metric([c.name], c.host.memory_mib << 20)
            limit.add_metric([c.name], capacity.memory_limit_mib(settings, c.host) << 20)
            reserved.add_metric([c.name], c.committed_mib << 20)
            disk.add_metric([c.name], c.host.disk_free_bytes)
            up.add_metric([c.name, c.status], 1)
        yield from (mem, limit, reserved, disk, up)

    def _replication(self, rows: list[SandboxRow]) -> Iterator[GaugeMetricFamily]:
        """Stopped sandboxes still without a seal replica on another node, and how long the oldest has waited (both
        0 when replicas are off: ``SBX_REPLICATE_SECONDS`` 0, or a single node)."""
        p = self.plane
        pending = GaugeMetricFamily("sbx_replication_pending", "Stopped sandboxes without a current seal replica.")
        lag = GaugeMetricFamily("sbx_replication_lag_seconds", "How long the oldest stopped sandbox without a "
                                "current seal replica has been stopped.")
        waiting: list[SandboxRow] = []
        if p.settings.replicate_seconds > 0 and len(p.router.agents()) > 1:
            have = p.replicas.all()
            waiting = [r for r in rows if r.state == "stopped" and r.id not in have]
        pending.add_metric([], len(waiting))
        now = utcnow()
        oldest = max(((now - _aware(r.updated_at)).total_seconds() for r in waiting), default=0.0)
        lag.add_metric([], max(0.0, oldest))
        yield from (pending, lag)


def _aware(when: dt.datetime) -> dt.datetime:
    """``when`` in UTC (SQLite gives naive datetimes back)."""
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)
