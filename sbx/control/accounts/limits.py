"""Abuse limits shared by every server replica of one PostgreSQL database (issue 35): the per-key token buckets and
the per-address wrong-key counts of :class:`sbx.api.auth.Gate`, kept in the database so that N replicas allow each
limit once in total, not N times.

- :meth:`SharedLimits.take` is one statement per request (``INSERT ... ON CONFLICT DO UPDATE ... RETURNING`` on
  ``rate_buckets``): the key's bucket is refilled at ``rate`` tokens/s up to ``burst`` since its last request and one
  token taken if there is one, atomically under the row's lock, so concurrent requests at any replicas never spend
  the same token twice. Time is the database's (``clock_timestamp()``), so replicas' clocks need not agree.
- :meth:`SharedLimits.attempt` / :meth:`SharedLimits.attempt_ok` count the keys one client address presents
  (``auth_attempts``): under a transaction-scoped advisory lock per address the attempts of the past ``window``
  seconds are counted and, below ``limit``, one is added *before* the key is looked up; a key that turns out good
  takes its attempt back. So at most ``limit`` wrong keys per window pass, even when many arrive at once at
  several replicas (an attempt in flight counts until it is known good).
- Rows that no longer matter (a bucket full again, an attempt older than its window) are deleted by
  :meth:`SharedLimits.cleanup`, which :meth:`take` runs at most once every ``cleanup_every`` seconds per process.

On SQLite (one server process) :func:`shared_limits` gives None and the Gate keeps its in-memory counters.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from sbx.control.store.database import Store

log = logging.getLogger("sbx.limits")

ATTEMPT_NS = 6
"""First key of the two-key advisory lock per client address (the namespaces 1-5 are sbx.control.store.locks')."""

_NOW = "extract(epoch FROM clock_timestamp())::float8"
_FILLED = "least(CAST(:burst AS float8), b.tokens + greatest(0, EXCLUDED.at - b.at) * :rate)"
_TAKE = text(f"""
INSERT INTO rate_buckets AS b (key, tokens, at, granted) VALUES (:key, :burst - 1, {_NOW}, true)
ON CONFLICT (key) DO UPDATE SET
    tokens = CASE WHEN {_FILLED} >= 1 THEN {_FILLED} - 1 ELSE {_FILLED} END,
    granted = {_FILLED} >= 1,
    at = greatest(b.at, EXCLUDED.at)
RETURNING granted, tokens""")


@dataclass(frozen=True)
class Attempt:
    """What :meth:`SharedLimits.attempt` decided: ``wait`` seconds until the address may try again (None: it may
    now), and the ``ticket`` of the attempt it counted (give it back with :meth:`SharedLimits.attempt_ok`)."""

    wait: float | None
    ticket: int | None


class SharedLimits:
    """Token buckets and wrong-key counts in PostgreSQL (module docstring); thread-safe. Database errors are
    raised as SQLAlchemy's."""

    def __init__(self, engine: Engine, cleanup_every: float = 60.0):
        self.engine = engine
        self.cleanup_every = cleanup_every
        self._next_cleanup = time.monotonic() + cleanup_every
        self._mutex = threading.Lock()
        self._longest_refill = 0.0  # seconds a bucket takes to fill, the most seen (rows older are full)
        self._longest_window = 0.0

    def take(self, key: str, rate: float, burst: int) -> float | None:
        """Take one token from ``key``'s bucket (``rate`` tokens per second, at most ``burst`` >= 1 held; a new
        key's bucket starts full). Returns None when a token was taken, else the seconds until one will be there
        (> 0; the request is refused and nothing is taken)."""
        with self.engine.connect() as conn:  # one statement, committed on its own: one round trip
            conn.execution_options(isolation_level="AUTOCOMMIT")
            granted, tokens = conn.execute(_TAKE, {"key": key, "rate": float(rate), "burst": int(burst)}).one()
        self._longest_refill = max(self._longest_refill, burst / rate)
        self._maybe_cleanup()
        if granted:
            return None
        return max(1e-3, (1.0 - float(tokens)) / rate)

    def attempt(self, client: str, limit: int, window: float) -> Attempt:
        """Count a key presented from address ``client``, unless that address already has ``limit`` attempts in
        the past ``window`` seconds: then ``Attempt(wait, None)`` with the seconds until the oldest of them leaves
        the window (nothing is counted). Otherwise ``Attempt(None, ticket)``: the attempt counts as a wrong key
        until :meth:`attempt_ok` takes it back."""
        self._longest_window = max(self._longest_window, window)
        with self.engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:ns, hashtext(:client))"),
                         {"ns": ATTEMPT_NS, "client": client})
            now = float(conn.execute(text(f"SELECT {_NOW}")).scalar_one())
            count, oldest = conn.execute(text("SELECT count(*), min(at) FROM auth_attempts WHERE client = :c "
                                              "AND at > :since"), {"c": client, "since": now - window}).one()
            if int(count) >= limit:
                return Attempt(max(1e-3, float(oldest) + window - now), None)
            ticket = conn.execute(text("INSERT INTO auth_attempts (client, at) VALUES (:c, :at) RETURNING id"),
                                  {"c": client, "at": now}).scalar_one()
        return Attempt(None, int(ticket))

    def attempt_ok(self, ticket: int) -> None:
        """The key of attempt ``ticket`` was good (or was refused for something other than being wrong): it no
        longer counts."""
        with self.engine.begin() as conn:
            conn.execute(text("DELETE FROM auth_attempts WHERE id = :id"), {"id": ticket})

    def cleanup(self) -> int:
        """Delete buckets that have filled up again since their last request (the same as no row; by the slowest
        refill this process has used) and attempts older than the longest window it has used; returns how many rows
        went."""
        with self.engine.begin() as conn:
            now = float(conn.execute(text(f"SELECT {_NOW}")).scalar_one())
            n = 0
            if self._longest_refill > 0:  # (none seen yet: this process knows no bucket's refill time)
                n += conn.execute(text("DELETE FROM rate_buckets WHERE at < :t"),
                                  {"t": now - self._longest_refill}).rowcount or 0
            if self._longest_window > 0:
                n += conn.execute(text("DELETE FROM auth_attempts WHERE at <= :t"),
                                  {"t": now - self._longest_window}).rowcount or 0
        return int(n)

    def _maybe_cleanup(self) -> None:
        now = time.monotonic()
        with self._mutex:
            if now < self._next_cleanup:
                return
            self._next_cleanup = now + self.cleanup_every
        try:
            self.cleanup()
        except Exception as e:  # the next request's call tries again in cleanup_every seconds
            log.warning("could not clean up the shared limits: %s", e)


def shared_limits(store: Store) -> SharedLimits | None:
    """The shared limits of ``store``'s database when several replicas may share it (PostgreSQL), else None. They
    get a connection pool of their own whose sessions commit without waiting for the WAL flush
    (``synchronous_commit = off``: a database crash may forget the last few tokens taken, never hand one out
    twice), so no request waits for a disk flush."""
    if store.engine.dialect.name != "postgresql":
        return None
    engine = create_engine(store.engine.url, pool_pre_ping=True, pool_size=10, max_overflow=20,
                           connect_args={"options": "-c synchronous_commit=off"})
    return SharedLimits(engine)
