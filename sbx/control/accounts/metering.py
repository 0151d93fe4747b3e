"""Metering (issue 12): per-second intervals of running time by size and of stored GiB, and the plan's starts.

Intervals are rows of the ``usage`` table (migration 0005). They are written by :meth:`Meter.on_state`, a store
state hook (:data:`sbx.control.store.database.StateHook`), inside the same database transaction as the sandbox's state
change, stamped with the same time as its ``updated_at``: a server killed with SIGKILL at any moment has either
committed the state change and its interval edge together, or neither, so no second is lost or counted twice.
The rules, per sandbox:

- entering ``running`` opens a ``run`` interval at its size (``gib`` = the size's memory); leaving ``running``
  (``stopping``, ``deleting``, ``error``, ``stopped`` by a crash) closes it. Stop time is billed up to the stop
  request; the checkpoint that follows is not.
- entering ``stopped`` opens a ``store`` interval; its ``gib`` (the disk's unique bytes on the volume plus the
  memory image) is filled in by :meth:`Meter.measure` right after the stop (measured once), and it closes when
  the sandbox resumes or is deleted.
- a named or automatic snapshot holds a ``store`` interval from its creation to its deletion (same transaction as
  its row).

Sandboxes keep running while the server is down, so an open ``run`` interval stays open across a crash; when the
server starts, the reconcile moves what the node reports as stopped, which closes the interval at that time.
:meth:`Meter.reconcile` then repairs any row whose intervals disagree with its state (databases from before
metering). Figures and prices: :mod:`sbx.control.accounts.pricing`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from sqlalchemy import DateTime, Float, Integer, String, func, or_, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from sbx.config import Settings
from sbx.control.accounts import pricing
from sbx.control.store.database import Base, SandboxRow, SnapshotRow, Store, as_utc

GIB = float(1 << 30)


RUNS = frozenset({"running", "migrating"})
"""States billed as running: a live migration (``running -> migrating -> running``) keeps one ``run`` interval."""


class UsageRow(Base):
    """One metered interval: ``kind`` ``run`` (``size``, ``gib`` = its memory) or ``store`` (``gib`` stored, of a
    stopped sandbox or of ``snapshot``); ``ended_at`` None while open."""

    __tablename__ = "usage"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    account_id: Mapped[str] = mapped_column(String(24), index=True)
    sandbox_id: Mapped[str | None] = mapped_column(String(16), nullable=True, index=True)
    snapshot: Mapped[str | None] = mapped_column(String(64), nullable=True)
    kind: Mapped[str] = mapped_column(String(8))
    size: Mapped[str | None] = mapped_column(String(32), nullable=True)
    gib: Mapped[float] = mapped_column(Float)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True, index=True)


class StartRow(Base):
    """A create, resume or fork (``kind``) by an account, for the plans' hourly start limit."""

    __tablename__ = "starts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    account_id: Mapped[str] = mapped_column(String(24), index=True)
    sandbox_id: Mapped[str] = mapped_column(String(16))
    kind: Mapped[str] = mapped_column(String(16))
    at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), index=True)


def _open(s: Session, sandbox_id: str, kind: str) -> Any:
    return select(UsageRow).where(UsageRow.sandbox_id == sandbox_id, UsageRow.kind == kind,
                                  UsageRow.snapshot.is_(None), UsageRow.ended_at.is_(None))


class Meter:
    """Writes and reads the ``usage`` and ``starts`` tables of ``store``; sizes and prices from ``settings``."""

    def __init__(self, store: Store, settings: Settings):
        self.store = store
        self.settings = settings
        self.pricing = pricing.Pricing.from_settings(dict(settings.pricing))

    @property
    def clock(self) -> Callable[[], dt.datetime]:
        return self.store.clock

    def _memory_gib(self, size: str) -> float:
        s = self.settings.sizes.get(size)
        return s.memory_mib / 1024 if s else 0.0

    # writing -----------------------------------------------------------------------------------------------------
    def on_state(self, s: Session, row: SandboxRow, old: str, now: dt.datetime) -> None:
        """The store state hook: close and open this sandbox's intervals for ``old -> row.state`` at ``now``."""
        new = row.state
        if "migrating" in (old, new) and {old, new} <= RUNS:
            return  # a live migration: the run goes on (on another node), one interval
        if old in RUNS or new == "running":
            for iv in s.scalars(_open(s, row.id, "run")):
                iv.ended_at = now
        if old == "stopped" or new in ("stopped", "deleted"):
            for iv in s.scalars(_open(s, row.id, "store")):
                iv.ended_at = now
        if new == "running":
            s.add(UsageRow(account_id=row.account_id, sandbox_id=row.id, kind="run", size=row.type,
                           gib=self._memory_gib(row.type), started_at=now))
        elif new == "stopped":
            last = s.scalar(select(UsageRow.gib).where(UsageRow.sandbox_id == row.id, UsageRow.kind == "store",
                                                       UsageRow.snapshot.is_(None))
                            .order_by(UsageRow.id.desc()).limit(1))
            s.add(UsageRow(account_id=row.account_id, sandbox_id=row.id, kind="store", size=row.type,
                           gib=float(last or 0.0), started_at=now))

    def measure(self, sandbox_id: str, stored_bytes: int) -> None:
        """Set the stored GiB (``stored_bytes`` / 2^30) of the sandbox's open ``store`` interval (measured right
        after its stop)."""
        with self.store.session() as s, s.begin():
            s.execute(update(UsageRow).where(UsageRow.sandbox_id == sandbox_id, UsageRow.kind == "store",
                                             UsageRow.snapshot.is_(None), UsageRow.ended_at.is_(None))
                      .values(gib=stored_bytes / GIB))

    def snapshot_added(self, row: SnapshotRow, stored_bytes: int) -> Callable[[Session], None]:
        """A store ``also`` callback opening the snapshot's ``store`` interval in the transaction adding it."""
        def also(s: Session) -> None:
            s.add(UsageRow(account_id=row.account_id, sandbox_id=row.sandbox_id, snapshot=row.name, kind="store",
                           gib=stored_bytes / GIB, started_at=self.clock()))
        return also

    def snapshot_removed(self, name: str) -> Callable[[Session], None]:
        """A store ``also`` callback closing the snapshot's interval in the transaction deleting it."""
        def also(s: Session) -> None:
            s.execute(update(UsageRow).where(UsageRow.snapshot == name, UsageRow.ended_at.is_(None))
                      .values(ended_at=self.clock()))
        return also

    def reconcile(self) -> int:
        """Make every sandbox's open intervals agree with its state (one open ``run`` while running, one open
        ``store`` while stopped, none otherwise; edges at the row's ``updated_at``) and every snapshot hold one
        open interval. Returns how many intervals it opened or closed. Called at start, after the node reconcile."""
        fixed = 0
        with self.store.session() as s, s.begin():
            for row in s.scalars(select(SandboxRow)):
                for kind, want in (("run", row.state in RUNS), ("store", row.state == "stopped")):
                    open_ = list(s.scalars(_open(s, row.id, kind)))
                    keep = open_[:1] if want else []
                    for iv in open_[len(keep):]:
                        iv.ended_at = max(as_utc(row.updated_at), as_utc(iv.started_at))
                        fixed += 1
                    if want and not keep:
                        s.add(UsageRow(account_id=row.account_id, sandbox_id=row.id, kind=kind, size=row.type,
                                       gib=self._memory_gib(row.type) if kind == "run" else 0.0,
                                       started_at=row.updated_at))
                        fixed += 1
            names = set(s.scalars(select(SnapshotRow.name)))
            held = set(s.scalars(select(UsageRow.snapshot).where(UsageRow.snapshot.is_not(None),
                                                                 UsageRow.ended_at.is_(None))))
            for snap in s.scalars(select(SnapshotRow).where(SnapshotRow.name.in_(names - held))):
                s.add(UsageRow(account_id=snap.account_id, sandbox_id=snap.sandbox_id, snapshot=snap.name,
                               kind="store", gib=snap.size_mib / 1024, started_at=snap.created_at))
                fixed += 1
            for name in held - names:
                s.execute(update(UsageRow).where(UsageRow.snapshot == name, UsageRow.ended_at.is_(None))
                          .values(ended_at=self.clock()))
                fixed += 1
        return fixed

    def record_start(self, account_id: str, sandbox_id: str, kind: str) -> None:
        """Count a start (``create``, ``resume``, ``fork``) of the account now."""
        with self.store.session() as s, s.begin():
            s.add(StartRow(account_id=account_id, sandbox_id=sandbox_id, kind=kind, at=self.clock()))

    # reading -----------------------------------------------------------------------------------------------------
    def starts_since(self, account_id: str, seconds: float = 3600.0) -> int:
        """How many starts the account made in the past ``seconds``."""
        since = self.clock() - dt.timedelta(seconds=seconds)
        with self.store.session() as s:
            return int(s.scalar(select(func.count(StartRow.id)).where(StartRow.account_id == account_id,
                                                                      StartRow.at > since)) or 0)

    def stored_gib(self, account_id: str) -> float:
        """GiB the account holds now: stopped sandboxes' disks and snapshots (open ``store`` intervals)."""
        with self.store.session() as s:
            return float(s.scalar(select(func.coalesce(func.sum(UsageRow.gib), 0.0)).where(
                UsageRow.account_id == account_id, UsageRow.kind == "store", UsageRow.ended_at.is_(None))) or 0.0)

    def intervals(self, account_id: str | None, start: dt.datetime, end: dt.datetime,
                  sandbox_id: str | None = None) -> list[pricing.Interval]:
        """Intervals overlapping ``[start, end)`` (of one account, or all when None; of one sandbox if given)."""
        with self.store.session() as s:
            q = select(UsageRow).where(UsageRow.started_at < end,
                                       or_(UsageRow.ended_at.is_(None), UsageRow.ended_at > start))
            if account_id is not None:
                q = q.where(UsageRow.account_id == account_id)
            if sandbox_id is not None:
                q = q.where(UsageRow.sandbox_id == sandbox_id, UsageRow.snapshot.is_(None))
            return [pricing.Interval(r.kind, r.size, r.gib, as_utc(r.started_at),
                                     as_utc(r.ended_at) if r.ended_at else None, r.sandbox_id, r.snapshot)
                    for r in s.scalars(q.order_by(UsageRow.id))]

    def usage(self, account_id: str | None, start: dt.datetime | None = None, end: dt.datetime | None = None,
              by: str | None = None, sandbox_id: str | None = None) -> dict[str, Any]:
        """The usage report (:func:`sbx.control.accounts.pricing.report`) of ``[start, end)`` (default: from the start
        of the current month, UTC, to now; for one ``sandbox_id``, from its beginning), plus ``from``, ``to``, ``by``,
        ``priceModel`` and ``currency``. An ``end`` in the future is read as now (a running sandbox is metered up to
        now, never to a ``to`` still to come); a ``start`` after that leaves an empty window."""
        now = self.clock()
        end = min(end, now) if end is not None else now
        if start is None:
            start = (dt.datetime(1970, 1, 1, tzinfo=dt.UTC) if sandbox_id is not None
                     else dt.datetime(now.year, now.month, 1, tzinfo=dt.UTC))
        end = max(end, start)
        rep = pricing.report(self.intervals(account_id, start, end, sandbox_id), start, end, by, self.pricing)
        return {"from": _iso(start), "to": _iso(end), "by": by, "priceModel": self.pricing.model,
                "currency": "USD", **rep}


def _iso(value: dt.datetime) -> str:
    return as_utc(value).strftime("%Y-%m-%dT%H:%M:%SZ")
