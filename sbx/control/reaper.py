"""Background duties of the control plane, run every ``tick`` seconds in one thread:

- TTL: a running sandbox whose ``ttl`` (seconds, 0 = never) has passed without activity (see
  :class:`sbx.control.sandboxes.activity.Activity`: an exec for its whole run, an attached log stream or job wait) is
  stopped, keeping its memory (disk only for a ``no_snapshots`` sandbox).
- Automatic snapshots: every ``settings.auto_snapshot_seconds`` (0 disables) a running sandbox gets a snapshot
  named ``auto-<id>-<YYYYmmddTHHMMSSZ>``; only the newest ``settings.auto_snapshot_keep`` automatic ones are kept.
  Skipped for ``no_snapshots`` sandboxes, and paused while the sandbox's node is short of disk
  (``snapshots_paused(node)``: :meth:`sbx.control.cluster.diskguard.DiskGuard.low`).
- Event pruning: once an hour, lifecycle events older than ``settings.event_retention_seconds`` are deleted.

With several server replicas on one PostgreSQL database only the elected one reaps: each tick a replica that does
not lead tries to take the ``reaper`` leader lock (:class:`sbx.control.store.locks.LeaderLock`); the leader keeps it
until it stops or dies (PostgreSQL then releases it and another replica takes over on its next tick). TTL uses the
activity seen by the leader's own process (exec/log streams through other replicas are not counted yet).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable

from sbx.control.errors import ControlError
from sbx.control.service import ControlPlane
from sbx.control.store.database import as_utc, utcnow
from sbx.control.store.locks import LeaderLoop
from sbx.node.types import NodeError

log = logging.getLogger("sbx.reaper")


class Reaper(LeaderLoop):
    """Runs :meth:`run_once` every ``tick`` seconds in a daemon thread between :meth:`start` and :meth:`stop`
    (:class:`sbx.control.store.locks.LeaderLoop`, duty ``reaper``; :meth:`stop` waits at most one tick plus the
    current pass)."""

    what = "reaper"
    pass_log = log

    def __init__(self, control: ControlPlane, tick: float = 5.0,
                 snapshots_paused: Callable[[str | None], bool] = lambda _node: False):
        super().__init__(control.store.engine, "reaper", tick, join_timeout=tick + 30)
        self.control = control
        self.snapshots_paused = snapshots_paused
        self.tick = tick
        self._first_seen: dict[str, float] = {}
        self._pruned_at: float | None = None

    PRUNE_EVERY = 3600.0
    """Seconds between two event prunings."""

    def prune_events(self) -> int:
        """Delete events older than ``settings.event_retention_seconds``; returns how many were deleted."""
        cutoff = utcnow() - dt.timedelta(seconds=self.control.settings.event_retention_seconds)
        self._pruned_at = time.monotonic()
        deleted = self.control.store.prune_events(cutoff)
        if deleted:
            log.info("pruned %d events older than %s", deleted, cutoff.isoformat())
        return deleted

    def run_once(self) -> None:
        """One pass over all sandboxes: TTL stops, then automatic snapshots; events are pruned once an hour."""
        settings = self.control.settings
        if self._pruned_at is None or time.monotonic() - self._pruned_at >= self.PRUNE_EVERY:
            self.prune_events()
        for row in self.control.store.list_sandboxes():
            if row.state != "running":
                self._first_seen.pop(row.id, None)
                continue
            if row.ttl and self.control.activity.idle_for(row.id) >= row.ttl:
                log.info("%s idle for %ss: stopping", row.id, row.ttl)
                try:
                    self.control.stop(row.id, keep_memory=True, wait=0, reason="idle")
                    self.control.add_event(row.id, {"event": "ttl", "id": row.id, "ttl": row.ttl})
                except ControlError as e:
                    log.info("ttl stop of %s skipped: %s", row.id, e.message)
                continue
            if settings.auto_snapshot_seconds > 0 and not row.no_snapshots and not self.snapshots_paused(row.node):
                self._auto_snapshot(row.id)

    def _auto_snapshot(self, sandbox_id: str) -> None:
        settings = self.control.settings
        autos = self.control.store.list_snapshots(sandbox_id, auto=True)
        now = time.monotonic()
        if autos:
            age = (utcnow() - as_utc(autos[-1].created_at)).total_seconds()
        else:
            age = now - self._first_seen.setdefault(sandbox_id, now)
        if age < settings.auto_snapshot_seconds:
            return
        name = f"auto-{sandbox_id}-{utcnow().strftime('%Y%m%dT%H%M%SZ')}"
        try:
            self.control.snapshot(sandbox_id, name, auto=True, wait=0)
        except ControlError as e:
            log.info("auto snapshot of %s skipped: %s", sandbox_id, e.message)
            return
        except NodeError as e:
            log.warning("auto snapshot of %s failed: %s", sandbox_id, e.message)
            return
        autos = self.control.store.list_snapshots(sandbox_id, auto=True)
        for old in autos[: max(0, len(autos) - settings.auto_snapshot_keep)]:
            try:
                self.control.delete_snapshot(old.name)
            except ControlError as e:
                log.warning("could not prune %s: %s", old.name, e.message)
