"""Accounts that end (issue 36): :class:`AccountEnds`, behind ``sbx admin account suspend|resume|delete`` and
``POST /v1/accounts/{id}/suspend``, ``POST /v1/accounts/{id}/resume``, ``DELETE /v1/accounts/{id}``.

- **suspend**: the account's state becomes ``suspended`` (:mod:`sbx.control.accounts.keys`; persisted, so it
  survives a restart) under the lifecycle lock and the account's admission lock (every replica's: issue 35), so a
  start that passed the plan's check before it is already counted and every start after it is refused (403
  ``account_suspended``, :meth:`Admission._plan_admit
  <sbx.control.sandboxes.admission.Admission._plan_admit>`); its keys and console sessions answer 403
  ``account_suspended``. Then a thread stops each of its sandboxes that runs, by the normal stop path with memory
  (``stopReason: "suspended"``), after waiting for one in an operation (a create or resume under way) to settle.
- **resume**: the state is ``active`` again; its sandboxes stay stopped (their user resumes them).
- **delete**: refused with 409 ``account_busy`` while a drain or a migration moves one of its sandboxes (nothing
  changes). Otherwise the state becomes ``deleting`` and its keys are removed in the same transaction (from then on
  they, and the port tokens of its hosted ports, answer 401); a thread deletes each of its sandboxes (any state,
  forks too: each is a sandbox of the account) by the normal delete path (which drops their routes, secret bindings
  and automatic snapshots), then its named snapshots and its secrets, and marks the account ``deleted``. Its row
  and its usage records stay, so the admin's usage report still shows what it used.

Crash safety: every step is idempotent and the account's state is written first, so a server killed at any point
finishes at its next start (:meth:`AccountEnds.finish_pending`: deletions in ``deleting`` go on, and a suspended
account's sandboxes still running are stopped). A deletion that can't finish (a sandbox's delete failed) leaves
the account ``deleting``, logged with the reason, and is tried again at the next start or ``delete``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from sbx.control.accounts.keys import AccountRow, Accounts
from sbx.control.cluster.drain import FINISHED, Drains
from sbx.control.errors import ControlError
from sbx.control.secrets.vault import Secrets
from sbx.control.store.database import SandboxRow, Store
from sbx.control.store.locks import AccountLocks
from sbx.control.store.state import TRANSIENT, Lifecycle

log = logging.getLogger("sbx.control")

SETTLE_WAIT = 600.0
"""Seconds a suspend or delete waits for one sandbox's operation in flight to end."""
ROUNDS = 3
"""Passes a deletion makes over what is left before it gives up until the next start (one pass is the rule)."""


class AccountEndPlane(Protocol):
    """What :class:`AccountEnds` uses of its control plane (:class:`sbx.control.service.ControlPlane` is one)."""

    @property
    def store(self) -> Store: ...
    @property
    def lifecycle(self) -> Lifecycle: ...
    @property
    def account_locks(self) -> AccountLocks: ...
    @property
    def accounts(self) -> Accounts: ...
    @property
    def drains(self) -> Drains: ...
    @property
    def secrets(self) -> Secrets: ...
    @property
    def moving_to(self) -> dict[str, tuple[str, int]]: ...
    def stop(self, sandbox_id: str, keep_memory: bool = True, wait: float | None = None,
             reason: str = "requested") -> SandboxRow: ...
    def delete(self, sandbox_id: str, wait: float | None = None) -> SandboxRow: ...
    def wait_settled(self, sandbox_id: str, timeout: float = 600.0) -> SandboxRow: ...
    def delete_snapshot(self, name: str) -> None: ...


class AccountEnds:
    """Suspend, resume and delete accounts of a control plane (``control.account_ends``). Thread-safe."""

    def __init__(self, cp: AccountEndPlane):
        self.cp = cp
        self._guard = threading.Lock()
        self._deleting: set[str] = set()  # accounts whose deletion thread runs in this process
        self._closed = False
        self.pause = 2.0
        """Seconds between a deletion's passes, times the pass number (tests make it short)."""

    def close(self) -> None:
        """At shutdown, before the plane's workers stop: the threads of this module start nothing more (what is
        left is finished at the next start)."""
        self._closed = True

    def _live(self, account_id: str) -> list[SandboxRow]:
        return self.cp.store.list_sandboxes(account_id=account_id)

    # suspend / resume ----------------------------------------------------------------------------------------------
    def suspend(self, account_id: str) -> tuple[AccountRow, list[str]]:
        """Suspend the account (module docstring); returns ``(row, ids of its sandboxes being stopped)``.
        Suspending a suspended account stops what still runs and changes nothing else. Raises 404, 403
        ``protected_account``, 409 ``account_deleted``."""
        with self.cp.account_locks.hold(account_id), self.cp.lifecycle.cond:  # (ordered with every replica's starts)
            row, _old = self.cp.accounts.set_state(account_id, "suspended", ("active",))
        ids = [r.id for r in self._live(account_id) if r.state == "running"
               or (r.state in TRANSIENT and r.state not in ("stopping", "deleting"))]
        if ids:
            threading.Thread(target=self._stop_all, args=(ids,), name=f"suspend-{account_id}", daemon=True).start()
        return row, ids

    def _stop_all(self, ids: list[str]) -> None:
        for sid in ids:
            if self._closed:
                return
            try:
                row = self.cp.wait_settled(sid, SETTLE_WAIT)
                if row.state == "running" and not self._closed:
                    self.cp.stop(sid, keep_memory=True, wait=SETTLE_WAIT, reason="suspended")
            except ControlError as e:
                log.warning("suspend: could not stop %s: %s %s", sid, e.code, e.message)
            except Exception:  # the server is closing (no workers), or a bug: the next start stops it
                if not self._closed:
                    log.exception("suspend: could not stop %s", sid)

    def resume(self, account_id: str) -> AccountRow:
        """Lift a suspension: the account is ``active`` again (its sandboxes stay stopped); an active account is
        returned as it is. Raises 404, 403 ``protected_account``, 409 ``account_deleted``."""
        row, _old = self.cp.accounts.set_state(account_id, "active", ("suspended",))
        return row

    # delete ------------------------------------------------------------------------------------------------------
    def moving(self, account_id: str) -> list[str]:
        """``"<sandbox id> (<why>)"`` for each of the account's sandboxes a live migration, a move to another node
        or a drain (one not finished with it yet) is moving now."""
        rows = {r.id: r for r in self._live(account_id)}
        out = [f"{sid} (migrating)" for sid, r in rows.items() if r.state == "migrating"]
        out += [f"{sid} (moving to {self.cp.moving_to[sid][0]})" for sid in rows
                if sid in self.cp.moving_to and rows[sid].state != "migrating"]
        for node in self.cp.drains.running():
            try:
                record: dict[str, Any] = self.cp.drains.get(node)
            except ControlError:
                continue
            out += [f"{e['id']} (drain of node {node})" for e in record.get("sandboxes", [])
                    if e.get("id") in rows and e.get("status") not in FINISHED]
        return sorted(set(out))

    def delete(self, account_id: str) -> tuple[AccountRow, list[str]]:
        """Delete the account (module docstring): returns ``(row in deleting, ids of its sandboxes being
        deleted)`` at once; the rest runs in a thread. A deleted account is returned as it is; one still
        ``deleting`` goes on. Raises 404, 403 ``protected_account``, 409 ``account_busy`` (a drain or migration
        moves one of its sandboxes: nothing changed)."""
        current = self.cp.accounts.get_account(account_id)
        if current.state == "deleted":
            return current, []
        if current.state != "deleting":
            moving = self.moving(account_id)
            if moving:
                raise ControlError("account_busy", f"account {account_id} can't be deleted while its sandboxes are "
                                   f"being moved: {', '.join(moving[:5])}; try again once the drain or migration "
                                   "has finished", 409)
        with self.cp.account_locks.hold(account_id), self.cp.lifecycle.cond:
            row, _old = self.cp.accounts.set_state(account_id, "deleting", ("active", "suspended"))
        ids = [r.id for r in self._live(account_id)]
        self._spawn(account_id)
        return row, ids

    def _spawn(self, account_id: str) -> None:
        with self._guard:
            if account_id in self._deleting:
                return
            self._deleting.add(account_id)
        threading.Thread(target=self._finish, args=(account_id,), name=f"delete-{account_id}", daemon=True).start()

    def _finish(self, account_id: str) -> None:
        problem: str | None = None
        try:
            for attempt in range(ROUNDS):
                if self._closed:
                    return
                try:
                    problem = self.finish(account_id)
                except Exception as e:  # the server is closing (no workers), or a bug: logged, tried again
                    if self._closed:
                        return
                    log.exception("deleting account %s", account_id)
                    problem = f"{type(e).__name__}: {e}"
                if problem is None:
                    return
                log.warning("deleting account %s (pass %d): %s", account_id, attempt + 1, problem)
                time.sleep(self.pause * (attempt + 1))
            log.error("account %s stays deleting: %s; the next start or delete tries again", account_id, problem)
        finally:
            with self._guard:
                self._deleting.discard(account_id)

    def finish(self, account_id: str) -> str | None:
        """One pass of a deletion (idempotent; the account is ``deleting``): delete its sandboxes and wait for
        them, then its named snapshots and secrets, then mark it ``deleted``. Returns None when done, else what is
        left and why (the account stays ``deleting``)."""
        left: list[str] = []
        for row in self._live(account_id):
            if self._closed:
                return "the server is shutting down"
            if row.state == "deleting":
                continue  # its delete is running (or a restart's settle finished it)
            try:
                self.cp.delete(row.id, wait=SETTLE_WAIT)
            except ControlError as e:
                if e.code != "not_found":
                    left.append(f"{row.id}: {e.code} {e.message}")
        for row in self._live(account_id):
            try:
                settled = self.cp.wait_settled(row.id, SETTLE_WAIT)
            except ControlError as e:
                left.append(f"{row.id}: {e.code} {e.message}")
                continue
            if settled.state != "deleted":
                left.append(f"{row.id} is {settled.state}")
        if left:
            return "sandboxes not deleted: " + "; ".join(sorted(set(left))[:5])
        for snap in self.cp.store.list_snapshots(account_id=account_id):
            try:
                self.cp.delete_snapshot(snap.name)
            except ControlError as e:
                if e.code != "not_found":
                    return f"snapshot {snap.label or snap.name}: {e.code} {e.message}"
        for secret in self.cp.secrets.all(account_id):
            try:
                self.cp.secrets.remove(account_id, secret.name)
            except ControlError as e:
                if e.code != "not_found":
                    return f"secret {secret.name}: {e.code} {e.message}"
        self.cp.accounts.set_state(account_id, "deleted", ("deleting",))
        log.info("account %s deleted", account_id)
        return None

    # start -------------------------------------------------------------------------------------------------------
    def finish_pending(self) -> dict[str, list[str]]:
        """At a server's start (after the sandboxes are reconciled): go on with every deletion a killed server
        left ``deleting``, and stop the sandboxes of suspended accounts that still run. Returns ``{"deleting":
        [...], "suspended": [...]}`` (the account ids it acted on)."""
        deleting = [r.id for r in self.cp.accounts.list_in_state("deleting")]
        for account_id in deleting:
            log.info("account %s was being deleted when the server stopped: finishing", account_id)
            self._spawn(account_id)
        suspended = []
        for acct in self.cp.accounts.list_in_state("suspended"):
            ids = [r.id for r in self._live(acct.id) if r.state == "running"]
            if ids:
                suspended.append(acct.id)
                threading.Thread(target=self._stop_all, args=(ids,), name=f"suspend-{acct.id}",
                                 daemon=True).start()
        return {"deleting": deleting, "suspended": suspended}
