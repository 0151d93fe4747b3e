"""A full host (issue 36): the loop that watches each node's free space while its sandboxes write, :class:`DiskGuard`.

Sandbox disks are sparse ext4 files on the node's XFS data volume; together they may promise far more than the volume
(or the host filesystem under its sparse backing file) holds, and admission (:mod:`sbx.control.cluster.capacity`)
looks at the room only when a sandbox starts. When that room really runs out, a disk's loop device can't write
and the sandbox's ext4 sees I/O errors instead of a clean ``ENOSPC``; a seal or a database write can fail half way.
So every ``settings.disk_check_seconds`` (``SBX_DISK_CHECK_SECONDS``, 5; 0 turns the loop off) the replica that
leads the ``diskguard`` duty measures every node: its room (:meth:`sbx.node.types.NodeAgent.info`,
``disk_free_bytes``: where the volume runs out first, as admission measures it) and what each running sandbox's disk
maps on the volume (:meth:`sbx.node.types.NodeAgent.stats`, ``disk_allocated_bytes``), whose change since the last
pass is the sandbox's growth rate. The node's level (:func:`level`):

- ``ok``: at least ``disk_reserve_gib`` free. Nothing to do.
- ``low``: below the reserve. New work is refused (``507 insufficient_capacity`` from admission, as before),
  automatic snapshots are paused (:meth:`DiskGuard.low`, which the reaper asks), and every running sandbox of the
  node gets a ``disk_low`` event (once per descent) naming the free bytes and the reserve.
- ``full``: below ``disk_floor_gib``. On top of the above, the sandboxes that grow are stopped, fastest first
  (:func:`choose_stops`), with ``stop_reason`` ``disk_full`` and a ``disk_full`` event before the stop; each keeps
  its memory when the image is likely to fit in half the room left (:func:`keep_memory`), else it halts (its disk
  is synced and unmounted either way, so its ext4 stays clean). The floor is the room kept for that: memory
  images, the stopped disks' last writes, seals and the database.

Back at ``ok``, each sandbox of the node that was told ``disk_low`` (running, or stopped with ``disk_full``) gets a
``disk_ok`` event: automatic snapshots go on, and a resume passes admission again (its owner resumes it; nothing is
resumed on its own, since the writer that filled the host would fill it again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from sbx.config import Settings
from sbx.control.cluster.router import NodeRouter
from sbx.control.errors import ControlError
from sbx.control.store.database import SandboxRow, Store
from sbx.control.store.locks import LeaderLoop
from sbx.node.types import NodeAgent, NodeError

log = logging.getLogger("sbx.diskguard")

GiB = 1 << 30
MiB = 1 << 20

Level = Literal["ok", "low", "full"]

STOP_REASON = "disk_full"
"""The ``stop_reason`` of a sandbox the guard stopped."""

HORIZON_CHECKS = 3
"""How many check periods ahead :func:`choose_stops` looks: growers whose combined rate would use the room left
within that time are all stopped in one pass, not one per pass."""

QUIET_RATE = 1 * MiB
"""Bytes per second of disk growth that do not make a sandbox a grower while at least half the floor is left: an
idle system's logs and journal commits (measured: ~0.1 MiB/s). Below half the floor every growing sandbox counts."""

MEMORY_SLACK = 64 * MiB
"""Added to a sandbox's memory use when judging whether its memory image fits (CRIU's own files, page tables)."""


def level(free_bytes: int, reserve_bytes: int, floor_bytes: int) -> Level:
    """``full`` below ``floor_bytes``, ``low`` below ``reserve_bytes``, else ``ok`` (all in bytes)."""
    if free_bytes < floor_bytes:
        return "full"
    if free_bytes < reserve_bytes:
        return "low"
    return "ok"


@dataclass(frozen=True)
class Grower:
    """A running sandbox as the guard sees it: ``id``, ``rate`` (bytes per second its disk grew since the last
    pass; 0 or less: not growing) and ``memory_bytes`` (the memory it uses, what a checkpoint would write)."""

    id: str
    rate: float
    memory_bytes: int


@dataclass(frozen=True)
class Stop:
    """A decision of :func:`choose_stops`: stop ``id``, keeping its memory or not; ``rate`` as measured."""

    id: str
    keep_memory: bool
    rate: float


def keep_memory(memory_bytes: int, budget: int) -> bool:
    """Whether a memory image of a sandbox using ``memory_bytes`` fits in ``budget`` bytes of room (with
    :data:`MEMORY_SLACK`)."""
    return memory_bytes + MEMORY_SLACK <= budget


def choose_stops(free_bytes: int, floor_bytes: int, growers: list[Grower], horizon_seconds: float) -> list[Stop]:
    """The sandboxes to stop now on a node with ``free_bytes`` of room and a floor of ``floor_bytes``.

    Nothing at or above the floor. Below it: the sandboxes that grow (faster than :data:`QUIET_RATE` while at
    least half the floor is left, at any rate below that), fastest first: the fastest always, then the next ones
    while those not yet chosen would, together, use the room left (``free_bytes``) within ``horizon_seconds``; the
    rest wait for the next pass (stopping a sandbox frees nothing, it stops the growth).
    Memory: the chosen ones share half the room left for their memory images, in the same order; one whose image
    would not fit in what remains of that half stops without memory (:func:`keep_memory`).
    """
    if free_bytes >= floor_bytes:
        return []
    quiet = QUIET_RATE if free_bytes >= floor_bytes // 2 else 0
    order = sorted((g for g in growers if g.rate > quiet), key=lambda g: (-g.rate, g.id))
    remaining = sum(g.rate for g in order)
    budget = max(free_bytes, 0) // 2
    stops: list[Stop] = []
    for g in order:
        if stops and remaining * horizon_seconds < free_bytes:
            break
        keep = keep_memory(g.memory_bytes, budget)
        if keep:
            budget -= g.memory_bytes + MEMORY_SLACK
        stops.append(Stop(g.id, keep, g.rate))
        remaining -= g.rate
    return stops


class GuardedPlane(Protocol):
    """What :class:`DiskGuard` uses of its control plane (:class:`sbx.control.service.ControlPlane` is one)."""

    settings: Settings
    store: Store
    router: NodeRouter

    def stop(self, sandbox_id: str, keep_memory: bool = True, wait: float | None = None,
             reason: str = "requested") -> SandboxRow: ...
    def add_event(self, sandbox_id: str, payload: dict[str, Any]) -> None: ...


@dataclass
class NodeWatch:
    """What the guard keeps per node between passes: the ``level``, the last ``free`` bytes, each running sandbox's
    last ``(monotonic seconds, allocated bytes)`` and the sandboxes told ``disk_low`` since the node was last ok."""

    level: Level = "ok"
    free: int = 0
    samples: dict[str, tuple[float, int]] = field(default_factory=dict)
    told: set[str] = field(default_factory=set)


class DiskGuard(LeaderLoop):
    """Runs :meth:`run_once` every ``period`` seconds (default ``settings.disk_check_seconds``) while this replica
    leads the ``diskguard`` duty (:class:`sbx.control.store.locks.LeaderLoop`). ``clock`` gives monotonic seconds
    (tests pass their own). Thread-safe: :meth:`low` and :meth:`view` may be called from any thread."""

    what = "disk guard"
    pass_log = log

    def __init__(self, control: GuardedPlane, period: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(control.store.engine, "diskguard",
                         control.settings.disk_check_seconds if period is None else period, join_timeout=60)
        self.cp = control
        self._clock = clock
        self._guard = threading.Lock()
        self._nodes: dict[str, NodeWatch] = {}

    @property
    def reserve_bytes(self) -> int:
        return int(self.cp.settings.disk_reserve_gib * GiB)

    @property
    def floor_bytes(self) -> int:
        """``disk_floor_gib`` in bytes, never above the reserve (a reserve of 0 turns both off)."""
        return min(int(self.cp.settings.disk_floor_gib * GiB), self.reserve_bytes)

    def low(self, node: str | None) -> bool:
        """Whether node ``node`` (None: the configured one) was below the reserve at the last pass."""
        name = node or self.cp.router.default_name
        with self._guard:
            w = self._nodes.get(name)
            return w is not None and w.level != "ok"

    def view(self) -> dict[str, dict[str, Any]]:
        """``{node: {"level": ok|low|full, "freeBytes": int}}`` as of the last pass (empty before the first)."""
        with self._guard:
            return {n: {"level": w.level, "freeBytes": w.free} for n, w in self._nodes.items()}

    def run_once(self) -> dict[str, list[Stop]]:
        """One pass over every node: measure, publish level changes, stop growers below the floor. Returns the
        stops asked for, per node. A node that can't be reached is skipped (its last level stays)."""
        rows = self.cp.store.list_sandboxes()
        out: dict[str, list[Stop]] = {}
        for name, (_url, agent) in self.cp.router.agents().items():
            mine = [r for r in rows if (r.node or self.cp.router.default_name) == name]
            try:
                out[name] = self.check_node(name, agent, mine)
            except NodeError as e:
                log.info("disk check of node %s skipped: %s", name, e.message)
        return out

    def check_node(self, name: str, agent: NodeAgent, rows: list[SandboxRow]) -> list[Stop]:
        """One node's check (see the module doc); ``rows`` are the sandboxes the store places on it. Raises
        ``NodeError`` when the node can't be measured."""
        free = agent.info().disk_free_bytes
        now = self._clock()
        with self._guard:
            w = self._nodes.setdefault(name, NodeWatch())
        running = [r for r in rows if r.state == "running"]
        growers: list[Grower] = []
        samples: dict[str, tuple[float, int]] = {}
        for r in running:
            try:
                st = agent.stats(r.id, space=False)
            except NodeError:
                continue
            samples[r.id] = (now, st.disk_allocated_bytes)
            before = w.samples.get(r.id)
            rate = 0.0
            if before is not None and now > before[0]:
                rate = (st.disk_allocated_bytes - before[1]) / (now - before[0])
            growers.append(Grower(r.id, rate, st.memory_used_mb * MiB))
        lvl = level(free, self.reserve_bytes, self.floor_bytes)
        with self._guard:
            previous = w.level
            w.level, w.free, w.samples = lvl, free, samples
        if lvl == "ok":
            if previous != "ok":
                self._tell_ok(name, w, rows, free)
            return []
        if previous == "ok" or any(r.id not in w.told for r in running):
            self._tell_low(name, w, running, free)
        stops = choose_stops(free, self.floor_bytes, growers, HORIZON_CHECKS * max(self.period, 1.0))
        for s in stops:
            self._stop_grower(name, s, free)
        return stops

    def _tell_low(self, name: str, w: NodeWatch, running: list[SandboxRow], free: int) -> None:
        for r in running:
            if r.id in w.told:
                continue
            w.told.add(r.id)
            self.cp.add_event(r.id, {"event": "disk_low", "id": r.id, "node": name, "freeBytes": free,
                                     "reserveBytes": self.reserve_bytes, "floorBytes": self.floor_bytes})
        log.warning("node %s: %d MiB free, below the reserve of %d MiB: new work refused, automatic snapshots "
                    "paused", name, free // MiB, self.reserve_bytes // MiB)

    def _tell_ok(self, name: str, w: NodeWatch, rows: list[SandboxRow], free: int) -> None:
        told = w.told
        w.told = set()
        for r in rows:
            if r.id in told or (r.state == "stopped" and r.stop_reason == STOP_REASON):
                self.cp.add_event(r.id, {"event": "disk_ok", "id": r.id, "node": name, "freeBytes": free,
                                         "reserveBytes": self.reserve_bytes})
        log.warning("node %s: %d MiB free again, above the reserve", name, free // MiB)

    def _stop_grower(self, name: str, s: Stop, free: int) -> None:
        log.warning("node %s: %d MiB free, below the floor of %d MiB: stopping %s (disk grows %.1f MiB/s, %s "
                    "memory)", name, free // MiB, self.floor_bytes // MiB, s.id, s.rate / MiB,
                    "with" if s.keep_memory else "without")
        self.cp.add_event(s.id, {"event": "disk_full", "id": s.id, "node": name, "freeBytes": free,
                                 "floorBytes": self.floor_bytes, "growthBytesPerSecond": int(s.rate),
                                 "keepMemory": s.keep_memory})
        try:
            self.cp.stop(s.id, keep_memory=s.keep_memory, wait=0, reason=STOP_REASON)
        except ControlError as e:
            log.info("disk_full stop of %s skipped: %s", s.id, e.message)
