"""Locks shared by every server replica of one PostgreSQL database (issue 10): PostgreSQL session-level advisory
locks, each held on a connection of its own so that it lives exactly as long as the holder (a replica killed with
SIGKILL closes its sockets; PostgreSQL then drops the session and every lock it held).

- :class:`SandboxLocks`: one lock per sandbox id (``pg_try_advisory_lock(1, hashtext(id))``), taken around the
  check-and-set of a lifecycle operation so two replicas never both start an operation on one sandbox.
- :class:`LeaderLock`: one lock per duty (``pg_try_advisory_lock(2, hashtext(name))``) kept by the replica that
  runs the duty (the reaper); the others try again on their next tick.

On SQLite (one server process per database file) both are no-ops: the in-process conditions of
:class:`sbx.control.state.Lifecycle` already serialise everything and the only process is the leader.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger("sbx.dblocks")

SANDBOX_NS = 1
"""First key of the two-key advisory lock for per-sandbox locks."""
LEADER_NS = 2
"""First key of the two-key advisory lock for leader election."""

_TRY = text("SELECT pg_try_advisory_lock(:ns, hashtext(:key))")
_UNLOCK = text("SELECT pg_advisory_unlock(:ns, hashtext(:key))")


def is_postgres(engine: Engine) -> bool:
    """True when ``engine`` talks to PostgreSQL (the only engine several processes may share)."""
    return engine.dialect.name == "postgresql"


def _try_lock(conn: Connection, ns: int, key: str) -> bool:
    got = bool(conn.execute(_TRY, {"ns": ns, "key": key}).scalar())
    conn.commit()  # session-level: the lock outlives the transaction; do not sit idle in one
    return got


class SandboxLocks:
    """Per-sandbox locks across processes. :meth:`hold` yields True once the lock is held (False after
    ``timeout`` seconds without it); on SQLite it yields True at once."""

    def __init__(self, engine: Engine, interval: float = 0.1):
        self.engine = engine if is_postgres(engine) else None
        self.interval = interval

    @contextmanager
    def hold(self, sandbox_id: str, timeout: float) -> Iterator[bool]:
        """Hold the lock of ``sandbox_id`` for the ``with`` block; tries every ``interval`` seconds until
        ``timeout`` (seconds, 0 = one try). Yields whether it is held; the block must not act when False."""
        if self.engine is None:
            yield True
            return
        conn = self.engine.connect()
        held = False
        try:
            deadline = time.monotonic() + max(0.0, timeout)
            while not (held := _try_lock(conn, SANDBOX_NS, sandbox_id)):
                if time.monotonic() >= deadline:
                    break
                time.sleep(self.interval)
            yield held
        finally:
            try:
                if held:
                    conn.execute(_UNLOCK, {"ns": SANDBOX_NS, "key": sandbox_id})
                    conn.commit()
                conn.close()
            except Exception:  # a broken connection: drop it, PostgreSQL drops its locks with the session
                log.warning("could not release the lock of %s; dropping its connection", sandbox_id, exc_info=True)
                conn.invalidate()
                conn.close()


class LeaderLock:
    """Leader election for one duty called ``name``: :meth:`try_lead` returns True while this process holds the
    lock (checking that the holding connection is alive), otherwise tries once to take it. :meth:`release` gives
    it up. Always True on SQLite."""

    def __init__(self, engine: Engine, name: str):
        self.engine = engine if is_postgres(engine) else None
        self.name = name
        self._conn: Connection | None = None
        self._mutex = threading.Lock()

    def try_lead(self) -> bool:
        """True when this process is the leader after the call. Never raises for a database error (it is then
        not the leader; the lock is released by PostgreSQL with the broken session)."""
        if self.engine is None:
            return True
        with self._mutex:
            try:
                if self._conn is not None:
                    self._conn.execute(text("SELECT 1"))
                    self._conn.commit()
                    return True
                conn = self.engine.connect()
                if _try_lock(conn, LEADER_NS, self.name):
                    self._conn = conn
                    log.info("leading %s", self.name)
                    return True
                conn.close()
                return False
            except Exception as e:
                log.warning("leader lock %s lost: %s", self.name, e)
                self._drop()
                return False

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.invalidate()
                self._conn.close()
            except Exception:
                pass
            self._conn = None

    def release(self) -> None:
        """Give up leadership: unlock at once (so another replica may lead on its next try), then return the
        connection; if that fails the connection is dropped and PostgreSQL releases the lock with the session."""
        with self._mutex:
            if self._conn is None:
                return
            try:
                self._conn.execute(_UNLOCK, {"ns": LEADER_NS, "key": self.name})
                self._conn.commit()
                self._conn.close()
                self._conn = None
            except Exception:
                self._drop()
