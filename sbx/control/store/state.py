"""The sandbox lifecycle state machine: states, the allowed transitions, and the in-process coordination that
makes concurrent requests wait for an operation in flight instead of failing.

States (``STATES``)::

    forking --> provisioning --> running --> stopping --> stopped --> resuming --> running
                                 |  ^  |                     |
                       migrating +--+  |                     |
                                    |                        |
                                    +------> deleting <------+----> deleted
    error: any operation that fails; from error a sandbox may be stopped, resumed or deleted.

Transient states (``TRANSIENT``) mark an operation in flight. Every transition goes through
:meth:`Lifecycle.transition`, which checks :data:`TRANSITIONS`, persists the new state through the store and
appends an event, so the state is written before a side effect starts (the transient state) and after it ends
(the final state).

A request that conflicts with an operation in flight waits for it (:data:`DEFAULT_WAIT` seconds, bounded) and
then proceeds, or gets ``409 busy`` with the current state. A sandbox that exists is never reported as missing.
Coordination is in-process, plus, on PostgreSQL (several server replicas on one database), a per-sandbox advisory
lock (:class:`sbx.control.store.locks.SandboxLocks`) around each check-and-set, so two replicas never both start an
operation on one sandbox; a replica waiting on another's operation sees its transient state in the database and
polls it every second. (A hold, :meth:`Lifecycle.acquire_hold`, is still only seen by its own replica.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sbx.control.errors import ControlError, busy, not_found
from sbx.control.store.database import SandboxRow, Store
from sbx.control.store.locks import OpLocks, SandboxLocks

STATES = (
    "provisioning",
    "running",
    "stopping",
    "stopped",
    "resuming",
    "migrating",
    "forking",
    "deleting",
    "deleted",
    "error",
)

TRANSIENT = frozenset({"provisioning", "stopping", "resuming", "migrating", "forking", "deleting"})
STABLE = frozenset(STATES) - TRANSIENT

TRANSITIONS: dict[str, frozenset[str]] = {
    "forking": frozenset({"provisioning", "error"}),
    "provisioning": frozenset({"running", "error"}),
    "running": frozenset({"stopping", "deleting", "error", "stopped", "migrating"}),
    "migrating": frozenset({"running", "error"}),
    "stopping": frozenset({"stopped", "error"}),
    "stopped": frozenset({"resuming", "deleting", "error"}),
    "resuming": frozenset({"running", "stopped", "error"}),
    "deleting": frozenset({"deleted", "error"}),
    "deleted": frozenset(),
    "error": frozenset({"stopping", "resuming", "deleting", "running", "stopped", "deleted"}),
}
"""``TRANSITIONS[a]`` is the set of states ``a`` may move to. ``resuming -> stopped`` is a resume that was refused
by the node (e.g. no memory image with ``require_memory``): nothing ran, the sandbox is as before. The ``error``
exits to running/stopped/deleted are used when the server reconciles with what the node reports at start.
``running -> migrating -> running`` is a live migration to another node (:mod:`sbx.control.sandboxes.migrating`): it
ends ``running`` on the destination, or on its source when the move failed; ``migrating -> error`` only when the node
layer can't say which node runs it (``migration_unconfirmed``). ``running -> stopped`` is a power-off/halt/reboot inside
or a crash the node noticed (after a reboot the sandbox goes on to ``resuming`` at once)."""

DEFAULT_WAIT = 30.0


def can_transition(src: str, dst: str) -> bool:
    """True when :data:`TRANSITIONS` allows ``src -> dst``."""
    return dst in TRANSITIONS.get(src, frozenset())


class Lifecycle:
    """Serialises lifecycle operations per sandbox and persists every transition.

    ``emit(row, old_state)`` is called after each persisted transition (the service turns it into event lines).
    """

    def __init__(self, store: Store, emit: Callable[[SandboxRow, str], None], wait: float = DEFAULT_WAIT):
        self.store = store
        self.emit = emit
        self.wait = wait
        self.cond = threading.Condition()
        self._holds: dict[str, int] = {}
        self.locks = SandboxLocks(store.engine)
        self.ops = OpLocks(store.engine)

    def notify(self) -> None:
        """Wake every waiter (after a transition, an event, or a hold release)."""
        with self.cond:
            self.cond.notify_all()

    def _get(self, sandbox_id: str) -> SandboxRow:
        row = self.store.get_sandbox(sandbox_id)
        if row is None or row.state == "deleted":
            raise not_found(f"sandbox {sandbox_id}")
        return row

    def get(self, sandbox_id: str) -> SandboxRow:
        """The live sandbox row; raises 404 ``not_found`` when unknown or deleted."""
        return self._get(sandbox_id)

    def _settled(self, sandbox_id: str, wait: float | None) -> SandboxRow:
        """Wait (holding ``self.cond``) until the sandbox is in a stable state with no hold on it."""
        deadline = time.monotonic() + (self.wait if wait is None else wait)
        while True:
            row = self._get(sandbox_id)
            if row.state not in TRANSIENT and not self._holds.get(sandbox_id):
                return row
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise busy(sandbox_id, row.state)
            self.cond.wait(min(remaining, 1.0))

    def transition(self, sandbox_id: str, dst: str, **fields: Any) -> SandboxRow:
        """Persist ``dst`` (and ``fields``) for the sandbox, checking :data:`TRANSITIONS`; emit and notify.

        Entering a transient state claims the operation for this replica (:class:`sbx.control.store.locks.OpLocks`;
        409 ``busy`` if another replica is settling it), leaving one releases it.

        Raises ``ControlError("invalid_transition", 409)`` for a move the table forbids (a bug or a race)."""
        with self.cond:
            row = self.store.get_sandbox(sandbox_id)
            if row is None:
                raise not_found(f"sandbox {sandbox_id}")
            if not can_transition(row.state, dst):
                raise ControlError(
                    "invalid_transition", f"sandbox {sandbox_id} cannot go from {row.state} to {dst}", 409, row.state
                )
            old = row.state
            entering, leaving = dst in TRANSIENT and old not in TRANSIENT, dst not in TRANSIENT and old in TRANSIENT
            if entering and not self.ops.claim(sandbox_id):  # another replica is settling what a dead one left
                raise busy(sandbox_id, old)
            try:
                row = self.store.update_sandbox(sandbox_id, state=dst, **fields)
            except BaseException:
                if entering:
                    self.ops.release(sandbox_id)
                raise
            if leaving:
                self.ops.release(sandbox_id)
            self.emit(row, old)
            self.cond.notify_all()
            return row

    def begin(
        self,
        sandbox_id: str,
        dst: str,
        allowed: Callable[[SandboxRow], ControlError | None] | None = None,
        wait: float | None = None,
        **fields: Any,
    ) -> tuple[SandboxRow, SandboxRow]:
        """Start an operation: wait (bounded) for any operation in flight, check the request against the settled
        row with ``allowed`` (returns an error to refuse), then persist the transient state ``dst``.

        Returns ``(before, after)`` rows. Raises 404 ``not_found``, 409 ``busy`` (still in flight after the wait),
        the error ``allowed`` returned, or 409 ``invalid_state`` when the table forbids ``state -> dst``."""
        with self.locks.hold(sandbox_id, self.wait if wait is None else wait) as held:
            if not held:  # another replica is starting an operation on it right now
                raise busy(sandbox_id, self._get(sandbox_id).state)
            return self._begin(sandbox_id, dst, allowed, wait, **fields)

    def _begin(
        self,
        sandbox_id: str,
        dst: str,
        allowed: Callable[[SandboxRow], ControlError | None] | None,
        wait: float | None,
        **fields: Any,
    ) -> tuple[SandboxRow, SandboxRow]:
        with self.cond:
            before = self._settled(sandbox_id, wait)
            if allowed is not None:
                err = allowed(before)
                if err is not None:
                    raise err
            if not can_transition(before.state, dst):
                raise ControlError(
                    "invalid_state",
                    f"sandbox {sandbox_id} is {before.state}; cannot start {dst}",
                    409,
                    before.state,
                )
            after = self.transition(sandbox_id, dst, **fields)
            return before, after

    def acquire_hold(
        self, sandbox_id: str, states: frozenset[str] | set[str], wait: float | None = None, what: str = "do this"
    ) -> SandboxRow:
        """Keep lifecycle operations off the sandbox while a side operation (snapshot, a fork's disk copy) runs:
        waits for a settled state, checks it is in ``states`` (else 409 ``invalid_state``), and makes other
        :meth:`begin` calls wait until :meth:`release_hold`. Holds may overlap and may be released from another
        thread. Returns the settled row."""
        with self.locks.hold(sandbox_id, self.wait if wait is None else wait) as held:
            if not held:
                raise busy(sandbox_id, self._get(sandbox_id).state)
            return self._acquire_hold(sandbox_id, states, wait, what)

    def _acquire_hold(
        self, sandbox_id: str, states: frozenset[str] | set[str], wait: float | None, what: str
    ) -> SandboxRow:
        with self.cond:
            row = self._settled(sandbox_id, wait)
            if row.state not in states:
                raise ControlError(
                    "invalid_state", f"sandbox {sandbox_id} is {row.state}; cannot {what}", 409, row.state
                )
            self._holds[sandbox_id] = self._holds.get(sandbox_id, 0) + 1
            return row

    def release_hold(self, sandbox_id: str) -> None:
        """End one :meth:`acquire_hold`."""
        with self.cond:
            left = self._holds.get(sandbox_id, 0) - 1
            if left > 0:
                self._holds[sandbox_id] = left
            else:
                self._holds.pop(sandbox_id, None)
            self.cond.notify_all()

    @contextmanager
    def hold(
        self, sandbox_id: str, states: frozenset[str] | set[str], wait: float | None = None, what: str = "do this"
    ) -> Iterator[SandboxRow]:
        """:meth:`acquire_hold` for the duration of a ``with`` block."""
        row = self.acquire_hold(sandbox_id, states, wait, what)
        try:
            yield row
        finally:
            self.release_hold(sandbox_id)

    def wait_for(self, sandbox_id: str, states: set[str], wait: float | None = None) -> SandboxRow:
        """Wait until the sandbox reaches a stable state; return it if it is in ``states``.

        Raises 404, 409 ``busy`` if still in flight after the wait, or 409 ``not_running`` (for
        ``states == {"running"}``) / ``invalid_state`` otherwise, with the current state."""
        with self.cond:
            deadline = time.monotonic() + (self.wait if wait is None else wait)
            while True:
                row = self._get(sandbox_id)
                if row.state in states:
                    return row
                if row.state not in TRANSIENT:
                    code = "not_running" if states == {"running"} else "invalid_state"
                    raise ControlError(code, f"sandbox {sandbox_id} is {row.state}", 409, row.state)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise busy(sandbox_id, row.state)
                self.cond.wait(min(remaining, 1.0))
