"""Admission of a start and the nodes it may go to: :class:`Admission`, a part of :class:`PlaneBase
<sbx.control.sandboxes.planebase.PlaneBase>`.

Placement's view of every node (:meth:`Admission._candidates`: status, room, memory promised, moves on their way),
the choice of a node for a new sandbox or fork (:meth:`Admission._place`), and the account's plan limits on
starts and stored GiB (:meth:`Admission._plan_admit`, :meth:`Admission._storage_admit`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sbx import metrics
from sbx.config import RUNTIME_CLASSES, Settings, Size
from sbx.control.accounts import plans
from sbx.control.accounts.keys import Accounts
from sbx.control.accounts.metering import Meter
from sbx.control.accounts.plans import Plan
from sbx.control.cluster import placement
from sbx.control.cluster.capacity import HostResources
from sbx.control.cluster.registry import NodeRegistry
from sbx.control.cluster.router import NodeRouter
from sbx.control.errors import ControlError
from sbx.control.store.database import Store
from sbx.control.store.locks import AccountLocks
from sbx.control.store.state import Lifecycle

log = logging.getLogger("sbx.control")


class Admission:
    """Placement and plan admission of the control plane; the attributes below are set by :class:`PlaneBase
    <sbx.control.sandboxes.planebase.PlaneBase>`."""

    settings: Settings
    store: Store
    lifecycle: Lifecycle
    router: NodeRouter
    registry: NodeRegistry
    accounts: Accounts
    meter: Meter
    account_locks: AccountLocks
    plans: dict[str, Plan]
    moving_to: dict[str, tuple[str, int]]
    _host: Callable[[], HostResources]

    def _candidates(self, exclude: str | None = None) -> list[placement.Candidate]:
        """Every node this server drives as placement sees it (:mod:`sbx.control.cluster.placement`): status from the
        registry, room from the embedded node's own measure (``local``) or the node's last heartbeat, memory
        promised from the store and by the moves on their way (:attr:`moving_to`), leaving out sandbox
        ``exclude``."""
        committed = placement.committed_by_node(self.store.list_sandboxes(), self.settings,
                                                self.router.default_name, exclude)
        for sid, (dst, mib) in list(self.moving_to.items()):
            if sid != exclude:
                committed[dst] = committed.get(dst, 0) + mib
        out = []
        for name, (url, _agent) in self.router.agents().items():
            row = self.registry.row(name)
            info = (row.info if row is not None else None) or {}
            if url == "local":
                host = self._host()
            else:
                host = HostResources(int(info.get("memory_mib", 0)), int(info.get("disk_free_bytes", 0)),
                                     f"{name}:{info.get('disk_path', '')}")
            fp = {str(k): str(v) for k, v in (info.get("fingerprint") or {}).items()}
            out.append(placement.Candidate(name, self.registry.status(name), host, committed.get(name, 0), fp))
        return out

    def _unreserve(self, sandbox_id: str) -> None:
        """Stop counting ``sandbox_id``'s move against its destination (:attr:`moving_to`)."""
        with self.lifecycle.cond:
            self.moving_to.pop(sandbox_id, None)

    def _place(self, size: Size, what: str, only: str | None = None, among: set[str] | None = None,
               count: bool = True) -> str:
        """The node a new sandbox or fork (``what`` at ``size``) goes to (:func:`sbx.control.cluster.placement.choose`);
        with ``among`` only one of those nodes (for one that is to get secrets:
        :meth:`sbx.control.cluster.router.NodeRouter.egress_nodes`). ``507 insufficient_capacity`` when none may take
        it, ``409 egress_proxy_unavailable`` when ``among`` is empty. The caller holds ``self.lifecycle.cond`` and
        writes the new row (with this node) before releasing it. ``count``: a refusal counts in
        ``sbx_admission_refusals_total`` (False for a first look that the operation repeats)."""
        cands = self._candidates()
        try:
            if among is not None:
                cands = [c for c in cands if c.name in among]
                if not cands:
                    raise ControlError("egress_proxy_unavailable", f"no node runs an egress proxy for {what}, so "
                                       "its secrets can't be bound", 409)
            return placement.choose(cands, self.settings, size, what, only=only)
        except ControlError as err:
            log.info("refused %s: %s", what, err.message)
            if count:
                refused(err)
            raise

    @contextmanager
    def _admitting(self, account_id: str) -> Iterator[None]:
        """Hold account ``account_id``'s admission across every replica of the database for the block (a
        PostgreSQL advisory lock, :class:`~sbx.control.store.locks.AccountLocks`; nothing on SQLite): a start's
        :meth:`_plan_admit` and the writes that make it count (its row or state, ``meter.record_start``) go in one
        block, so two replicas never both pass the account's last free start or running place. Enter it before
        ``self.lifecycle.cond`` and keep node work out of it. Raises 409 ``busy`` after 30 s without the lock."""
        with self.account_locks.hold(account_id):
            yield

    def _plan_admit(self, account_id: str, size: Size, kind: str, what: str, sandbox_id: str | None = None,
                    count: bool = True, runtime: str | None = None) -> None:
        """Refuse a start (``kind`` ``create``/``resume``/``fork`` of ``what`` at ``size``, of runtime class
        ``runtime``, None: the container class) with 403 ``plan_limit``
        when the account's plan does not allow it (:func:`sbx.control.accounts.plans.check`), 403 ``account_suspended``
        / 409 ``account_deleted`` when the account has ended (:meth:`Accounts.require_active`); else count the start.
        The caller holds ``self.lifecycle.cond``, so two starts never both pass the last free place (nor one an
        account's suspension, which takes it too: :mod:`sbx.control.cluster.accountend`), and :meth:`_admitting`,
        which makes that hold across replicas."""
        account = self.accounts.require_active(account_id)
        plan = self.plans.get(account.plan) or self.plans["trial"]
        busy = {"provisioning", "running", "resuming", "migrating", "forking"}
        running = sum(1 for r in self.store.list_sandboxes(account_id=account_id)
                      if r.state in busy and r.id != sandbox_id)
        try:  # (count: as for _place)
            plans.check(self.plans, plan, size.name, self.meter.starts_since(account_id), running, what,
                        runtime or RUNTIME_CLASSES[0])
        except ControlError as err:
            if count:
                refused(err)
            raise

    def _default_runtime(self, account_id: str) -> str:
        """The runtime class of a sandbox the account creates without naming one: the server's
        ``default_runtime`` when the account's plan allows it, else the plan's first class."""
        plan = self.plans.get(self.accounts.get_account(account_id).plan) or self.plans["trial"]
        return plan.default_runtime(self.settings.default_runtime)

    def _storage_admit(self, account_id: str, what: str) -> None:
        """403 ``plan_limit`` (limit ``storage_gib``) when the account's stored GiB have reached its plan's
        included storage."""
        plan = self.plans.get(self.accounts.get_account(account_id).plan) or self.plans["trial"]
        stored = self.meter.stored_gib(account_id)
        if plan.storage_gib and stored >= plan.storage_gib:
            raise refused(plans.refusal(self.plans, plan, "storage_gib", stored + 1,
                                        f"{what}: {stored:.1f} GiB stored reach the {plan.storage_gib:g} GiB included"))

    def account_plan(self, account_id: str) -> dict[str, Any]:
        """The account's plan and what it uses now: ``{"plan": {...}, "used": {"startsLastHour", "running",
        "storedGiB"}}``."""
        account = self.accounts.get_account(account_id)
        plan = self.plans.get(account.plan) or self.plans["trial"]
        busy = {"provisioning", "running", "resuming", "migrating", "forking"}
        rows = self.store.list_sandboxes(account_id=account_id)
        return {"plan": plan.view(), "used": {
            "startsLastHour": self.meter.starts_since(account_id),
            "running": sum(1 for r in rows if r.state in busy),
            "storedGiB": round(self.meter.stored_gib(account_id), 6)}}


def refused(err: ControlError) -> ControlError:
    """Count ``err``, a refused start, in ``sbx_admission_refusals_total{code,status}``; returns it."""
    metrics.ADMISSION_REFUSALS.labels(code=err.code, status=str(err.status)).inc()
    return err
