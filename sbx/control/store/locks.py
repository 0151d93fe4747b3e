"""Locks shared by every server replica of one PostgreSQL database (issue 10): PostgreSQL session-level advisory
locks, each held on a connection of its own so that it lives exactly as long as the holder (a replica killed with
SIGKILL closes its sockets; PostgreSQL then drops the session and every lock it held).

- :class:`SandboxLocks`: one lock per sandbox id (``pg_try_advisory_lock(1, hashtext(id))``), taken around the
  check-and-set of a lifecycle operation so two replicas never both start an operation on one sandbox.
- :class:`LeaderLock`: one lock per duty (``pg_try_advisory_lock(2, hashtext(name))``) kept by the replica that
  runs the duty (the reaper); the others try again on their next tick. :class:`LeaderLoop` runs such a duty.
- :class:`OpLocks`: who owns the operation in flight on a sandbox (``pg_try_advisory_lock(3, hashtext(id))``, held
  from the transition into a transient state until the transition out of it), and which replicas are alive (each
  holds ``pg_advisory_lock_shared(4, 0)``). A transient row whose lock another replica can take was left by a dead
  replica: it is settled from what the node reports instead of waiting forever.
- :class:`AccountLocks`: one lock per account (``pg_advisory_xact_lock(5, hashtext(id))``, transaction-scoped on a
  connection of its own) held around a start's plan admission: the check of the account's limits and the writes that
  make the start count (its row, its start record), so two replicas never both pass an account's last free start or
  running place (issue 35). Waits up to ``timeout`` seconds, then 409 ``busy``.

On SQLite (one server process per database file) both are no-ops: the in-process conditions of
:class:`sbx.control.store.state.Lifecycle` already serialise everything and the only process is the leader.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError

from sbx.control.errors import ControlError

log = logging.getLogger("sbx.dblocks")

SANDBOX_NS = 1
"""First key of the two-key advisory lock for per-sandbox locks."""
LEADER_NS = 2
"""First key of the two-key advisory lock for leader election."""
OP_NS = 3
"""First key of the two-key advisory lock that marks a replica's operation in flight on a sandbox."""
ALIVE_NS = 4
"""First key of the shared advisory lock every live replica holds."""
ACCOUNT_NS = 5
"""First key of the two-key transaction-scoped advisory lock around an account's plan admission."""

_TRY = text("SELECT pg_try_advisory_lock(:ns, hashtext(:key))")
_UNLOCK = text("SELECT pg_advisory_unlock(:ns, hashtext(:key))")


def is_postgres(engine: Engine) -> bool:
    """True when ``engine`` talks to PostgreSQL (the only engine several processes may share)."""
    return engine.dialect.name == "postgresql"


def _discard(conn: Connection) -> None:
    """Throw away a connection whose session may be broken (never raises): PostgreSQL ends the session, and every
    advisory lock it held goes with it."""
    try:
        conn.invalidate()
        conn.close()
    except Exception:
        pass


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
                _discard(conn)


class AccountLocks:
    """Per-account admission locks across processes (module docstring). :meth:`hold` blocks in PostgreSQL (no
    polling) until the account's lock is held; a no-op on SQLite, where the caller's in-process lock suffices.
    Take it before any in-process lock (``Lifecycle.cond``), never while holding one: a thread waiting here with
    ``cond`` held would stop every other thread of the process that holds this lock and wants ``cond``."""

    def __init__(self, engine: Engine, timeout: float = 30.0):
        self.engine = engine if is_postgres(engine) else None
        self.timeout = timeout

    @contextmanager
    def hold(self, account_id: str) -> Iterator[None]:
        """Hold ``account_id``'s admission lock for the ``with`` block (its transaction commits at the end, which
        releases it; a replica that dies loses it with its session). Raises 409 ``busy`` when another process held
        it for ``timeout`` seconds. What the block writes must be committed before it ends (the store's sessions
        commit on their own), so the next holder reads it."""
        if self.engine is None:
            yield
            return
        conn = self.engine.connect()
        try:
            conn.execute(text(f"SET LOCAL lock_timeout = '{max(1, int(self.timeout * 1000))}ms'"))
            conn.execute(text("SELECT pg_advisory_xact_lock(:ns, hashtext(:key))"),
                         {"ns": ACCOUNT_NS, "key": account_id})
        except OperationalError as e:
            _discard(conn)
            if getattr(e.orig, "sqlstate", None) == "55P03":  # lock_not_available: lock_timeout ran out
                raise ControlError("busy", f"another start of account {account_id} is being admitted; try again "
                                   "shortly", 409) from None
            raise
        try:
            yield
        finally:
            try:
                conn.commit()
                conn.close()
            except Exception:  # a broken connection: drop it, PostgreSQL drops the lock with the session
                log.warning("could not release the admission lock of %s; dropping its connection", account_id,
                            exc_info=True)
                _discard(conn)


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
            _discard(self._conn)
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


class LeaderLoop:
    """A duty run by the replica that leads it: :meth:`run_once` every ``period`` seconds in a daemon thread named
    ``sbx-<duty>``, between :meth:`start` and :meth:`stop`, while :class:`LeaderLock` ``duty`` is held (tried
    again each period; ``leading`` says the last answer). A pass that raises is logged to ``pass_log`` as
    "``what`` pass failed" and the loop goes on. ``period`` 0 or less: :meth:`start` does nothing.
    :meth:`stop` waits ``join_timeout`` seconds at most for the pass under way, then gives up the leadership."""

    what = "duty"
    pass_log = log

    def __init__(self, engine: Engine, duty: str, period: float, join_timeout: float = 60.0):
        self.period = period
        self.leader = LeaderLock(engine, duty)
        self.leading = False
        self._duty = duty
        self._join_timeout = join_timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> object:
        """One pass of the duty (what subclasses do)."""
        raise NotImplementedError

    def start(self) -> None:
        """Start the loop (nothing when the period is 0 or it runs already)."""
        if self.period <= 0 or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"sbx-{self._duty}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the loop and give up the leadership."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._join_timeout)
            self._thread = None
        self.leader.release()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.leading = self.leader.try_lead()
                if self.leading:
                    self.run_once()
            except Exception:  # keep the loop after a bug in one pass
                self.pass_log.exception("%s pass failed", self.what)


class OpLocks:
    """Ownership of operations in flight, across replicas (see the module docstring). All locks of this process
    live on one connection of their own, so they end with the process (SIGKILL included). No-ops on SQLite, where
    the only process owns everything and nothing is ever an orphan.

    Advisory locks stack within one session: every :meth:`claim` takes the lock once more and every
    :meth:`release` gives one back, so an orphan settled by :meth:`orphaned` that starts an operation of its own
    (finishing a deletion) stays owned until that operation ends. :meth:`orphaned` never reports this process's
    own operations (they are counted in-process)."""

    def __init__(self, engine: Engine, interval: float = 0.1):
        self.engine = engine if is_postgres(engine) else None
        self.interval = interval
        self._conn: Connection | None = None
        self._mutex = threading.Lock()
        self._held: dict[str, int] = {}
        self._alive = False

    def _connection(self) -> Connection:
        assert self.engine is not None
        if self._conn is None:
            self._conn = self.engine.connect()
            self._alive = False
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            _discard(self._conn)
            self._conn = None
        if self._held:
            log.error("the operation locks of %s were lost with their connection", sorted(self._held))
        self._held.clear()

    def others_alive(self) -> bool:
        """True when another replica is alive on this database (it holds the shared liveness lock). Always
        False on SQLite."""
        if self.engine is None:
            return False
        with self._mutex:
            try:
                conn = self._connection()
                n = conn.execute(text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = :ns AND objid = 0 "
                    "AND objsubid = 2 AND granted AND pid <> pg_backend_pid()"), {"ns": ALIVE_NS}).scalar()
                conn.commit()
                return bool(n)
            except Exception as e:
                log.warning("could not see the other replicas: %s", e)
                self._drop()
                return False

    def register(self) -> None:
        """Mark this replica alive (until its connection ends)."""
        if self.engine is None:
            return
        with self._mutex:
            try:
                conn = self._connection()
                if not self._alive:
                    conn.execute(text("SELECT pg_advisory_lock_shared(:ns, 0)"), {"ns": ALIVE_NS})
                    conn.commit()
                    self._alive = True
            except Exception as e:
                log.warning("could not mark this replica alive: %s", e)
                self._drop()

    def _take(self, sandbox_id: str) -> bool:
        """One more hold of the lock (caller has the mutex); False when another session has it."""
        if _try_lock(self._connection(), OP_NS, sandbox_id):
            self._held[sandbox_id] = self._held.get(sandbox_id, 0) + 1
            return True
        return False

    def claim(self, sandbox_id: str, timeout: float = 10.0) -> bool:
        """Own the operation about to start on ``sandbox_id``; tries every ``interval`` seconds for at most
        ``timeout`` seconds (another replica may be settling an orphan of it). True once owned (at once on
        SQLite); False on timeout or a database error."""
        if self.engine is None:
            return True
        deadline = time.monotonic() + timeout
        while True:
            with self._mutex:
                try:
                    if self._take(sandbox_id):
                        return True
                except Exception as e:
                    log.warning("could not claim the operation on %s: %s", sandbox_id, e)
                    self._drop()
                    return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.interval)

    def release(self, sandbox_id: str) -> None:
        """Give back one :meth:`claim` of ``sandbox_id`` (its operation's final state is written). Nothing
        happens for a sandbox this process does not hold."""
        if self.engine is None:
            return
        with self._mutex:
            n = self._held.get(sandbox_id, 0)
            if not n:
                return
            if n > 1:
                self._held[sandbox_id] = n - 1
            else:
                del self._held[sandbox_id]
            try:
                assert self._conn is not None
                self._conn.execute(_UNLOCK, {"ns": OP_NS, "key": sandbox_id})
                self._conn.commit()
            except Exception as e:
                log.warning("could not release the operation lock of %s: %s", sandbox_id, e)
                self._drop()

    def owns(self, sandbox_id: str) -> bool:
        """True when this process holds the operation on ``sandbox_id`` (always True on SQLite)."""
        if self.engine is None:
            return True
        with self._mutex:
            return sandbox_id in self._held

    @contextmanager
    def orphaned(self, sandbox_id: str) -> Iterator[bool]:
        """Yields True, holding its lock for the block, when the operation on ``sandbox_id`` has no live owner (a
        dead replica left it); False when this or another live replica owns it. Always False on SQLite."""
        if self.engine is None:
            yield False
            return
        got = False
        with self._mutex:
            if sandbox_id not in self._held:
                try:
                    got = self._take(sandbox_id)
                except Exception as e:
                    log.warning("could not check the operation on %s: %s", sandbox_id, e)
                    self._drop()
        try:
            yield got
        finally:
            if got:
                self.release(sandbox_id)

    def close(self) -> None:
        """Release everything (at shutdown)."""
        with self._mutex:
            conn, self._conn = self._conn, None
            self._held.clear()
            self._alive = False
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass
