"""API endpoints for accounts, API keys, plans and usage (issue 12); added to the ``/v1`` router by
:func:`register`::

    POST   /v1/accounts                      new account + first key (admin)   201 {"account", "key"}
    GET    /v1/accounts                      every account (admin)             200 {"accounts": [...]}
    PATCH  /v1/accounts/{id}                 change its plan (admin)           200 {"account"}
    POST   /v1/accounts/{id}/suspend         suspend it (admin)                200 {"account", "sandboxes"}
    POST   /v1/accounts/{id}/resume          lift a suspension (admin)         200 {"account"}
    DELETE /v1/accounts/{id}                 delete it (admin)                 202 {"account", "sandboxes"}
    POST   /v1/accounts/{id}/keys            new key (admin, or the account)   201 {"key"} (with its token, once)
    GET    /v1/accounts/{id}/keys            its keys (no tokens)              200 {"keys": [...]}
    DELETE /v1/keys/{key}                    revoke a key                      200 {"key"}
    GET    /v1/account[?account=ID]          the key's account, plan, use      200 {"account", "plan", "used"}
    GET    /v1/plans                         the plan table                    200 {"plans": [...]}
    GET    /v1/usage?from&to&by&account&sandbox   metered use and cost              200 (see :class:`schemas.Usage`)

An account's key sees only its own account (another's id answers 404 ``not_found``); the admin key sees all.
``admin`` routes answer 403 ``admin_only`` to an account's key. Suspend, resume and delete (issue 36) are
:mod:`sbx.control.cluster.accountend`; the first account answers them 403 ``protected_account``.
"""

import calendar
import datetime as dt
from typing import Any

from fastapi import APIRouter, Depends, Query

from sbx.api import schemas as S
from sbx.api import schemas_accounts as SA
from sbx.api.auth import principal, require_admin
from sbx.api.models import CreateKey, with_plans
from sbx.control.accounts.keys import Principal, account_view, key_view
from sbx.control.errors import ControlError, not_found
from sbx.control.service import ControlPlane


def _visible_account(who: Principal, account_id: str) -> str:
    if not who.sees(account_id):
        raise not_found(f"account {account_id}")
    return account_id


WHEN_PATTERN = (r"^[1-9][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
                r"(T([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9](\.[0-9]{1,6})?)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?)?$")
"""``from``/``to`` of ``GET /v1/usage``: a date, or a date and time with an optional zone (no zone = UTC)."""


def parse_when(value: str | None, field: str) -> dt.datetime | None:
    """``2026-12-01`` (midnight UTC) or an ISO 8601 time (``2026-12-01T10:00:00Z``; no zone = UTC) as aware UTC;
    a day past the month's end (``2026-02-31``) is read as its last day. Raises 400 ``invalid_<field>``."""
    if value is None:
        return None
    value = value.strip()
    if len(value) >= 10 and value[4] == "-" and value[7] == "-" and value[:4].isdigit() and value[5:7].isdigit() \
            and value[8:10].isdigit() and 1 <= int(value[5:7]) <= 12:
        last = calendar.monthrange(int(value[:4]), int(value[5:7]))[1]
        if int(value[8:10]) > last:
            value = f"{value[:8]}{last:02d}{value[10:]}"
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise ControlError(f"invalid_{field}", f"{field} must be a date (2026-12-01) or an ISO 8601 time "
                           f"(2026-12-01T10:00:00Z), got {value[:60]!r}", 400, field=field) from None
    return when.replace(tzinfo=dt.UTC) if when.tzinfo is None else when.astimezone(dt.UTC)


def register(v1: APIRouter, cp: ControlPlane) -> None:
    """Add the account, key, plan and usage endpoints to ``v1``."""
    Who = Depends(principal)
    CreateAccount, UpdateAccount = with_plans(list(cp.plans))

    @v1.post("/accounts", status_code=201, tags=["accounts"], response_model=SA.AccountCreated,
             responses=S.errors(400, 403, 409))
    def create_account(body: CreateAccount, who: Principal = Who) -> dict[str, Any]:  # type: ignore[valid-type]
        """Create an account (admin) with a first key named ``default``; the key's ``token`` is shown only here."""
        require_admin(who)
        row, key, token = cp.accounts.create_account(body.name, body.plan)  # type: ignore[attr-defined]
        return {"account": account_view(row), "key": key_view(key, token)}

    @v1.get("/accounts", tags=["accounts"], response_model=SA.AccountList, responses=S.errors(403))
    def list_accounts(who: Principal = Who) -> dict[str, Any]:
        """Every account, oldest first (admin)."""
        require_admin(who)
        return {"accounts": [account_view(r) for r in cp.accounts.list_accounts()]}

    @v1.patch("/accounts/{account_id}", tags=["accounts"], response_model=SA.AccountOut,
              responses=S.errors(400, 403, 404))
    def update_account(account_id: str, body: UpdateAccount,  # type: ignore[valid-type]
                       who: Principal = Who) -> dict[str, Any]:
        """Move an account to another plan (admin)."""
        require_admin(who)
        return {"account": account_view(cp.accounts.set_plan(account_id, body.plan))}  # type: ignore[attr-defined]

    @v1.post("/accounts/{account_id}/suspend", tags=["accounts"], response_model=SA.AccountEnded,
             responses=S.errors(403, 404, 409))
    def suspend_account(account_id: str, who: Principal = Who) -> dict[str, Any]:
        """Suspend an account (admin): from now on its keys and console sessions answer 403 ``account_suspended``
        and its sandboxes may not be created, resumed or forked; those that run are stopped with their memory
        (``stopReason: "suspended"``; ``sandboxes`` names them, the stops run in the background). Survives a
        restart. 403 ``protected_account`` (the first account), 404, 409 ``account_deleted``."""
        require_admin(who)
        row, ids = cp.account_ends.suspend(account_id)
        return {"account": account_view(row), "sandboxes": ids}

    @v1.post("/accounts/{account_id}/resume", tags=["accounts"], response_model=SA.AccountOut,
             responses=S.errors(403, 404, 409))
    def resume_account(account_id: str, who: Principal = Who) -> dict[str, Any]:
        """Lift a suspension (admin): its keys work again; its sandboxes stay stopped until resumed. An active
        account is returned as it is. 403 ``protected_account``, 404, 409 ``account_deleted``."""
        require_admin(who)
        return {"account": account_view(cp.account_ends.resume(account_id))}

    @v1.delete("/accounts/{account_id}", status_code=202, tags=["accounts"], response_model=SA.AccountEnded,
               responses=S.errors(403, 404, 409))
    def delete_account(account_id: str, who: Principal = Who) -> dict[str, Any]:
        """Delete an account (admin): its keys answer 401 at once (port tokens of its hosted ports too); its
        sandboxes (any state, forks too), snapshots, secrets and routes are removed in the background, while it
        is ``deleting``, then it is ``deleted`` (see ``GET /v1/account?account=ID``). Its usage records stay in
        the usage report. 403 ``protected_account`` (the first account), 404, 409 ``account_busy`` while a drain
        or migration moves one of its sandboxes (nothing changed). A deleted account is returned as it is."""
        require_admin(who)
        row, ids = cp.account_ends.delete(account_id)
        return {"account": account_view(row), "sandboxes": ids}

    @v1.post("/accounts/{account_id}/keys", status_code=201, tags=["accounts"], response_model=SA.KeyOut,
             responses=S.errors(400, 404))
    def create_key(account_id: str, body: CreateKey | None = None, who: Principal = Who) -> dict[str, Any]:
        """A new key for the account (the admin, or a key of that account); its ``token`` is shown only here."""
        b = body or CreateKey.model_validate({})
        row, token = cp.accounts.create_key(_visible_account(who, account_id), b.name, b.expires_in)
        return {"key": key_view(row, token)}

    @v1.get("/accounts/{account_id}/keys", tags=["accounts"], response_model=SA.KeyList, responses=S.errors(404))
    def list_keys(account_id: str, who: Principal = Who) -> dict[str, Any]:
        """The account's keys, oldest first (prefixes only, never tokens)."""
        cp.accounts.get_account(_visible_account(who, account_id))
        return {"keys": [key_view(r) for r in cp.accounts.list_keys(account_id)]}

    @v1.delete("/keys/{key_id}", tags=["accounts"], response_model=SA.KeyOut, responses=S.errors(403, 404))
    def revoke_key(key_id: str, who: Principal = Who) -> dict[str, Any]:
        """Revoke a key: from now on it answers 401. 403 ``protected_key`` for the installation's admin key."""
        row = cp.accounts.get_key(key_id)
        if not who.sees(row.account_id):
            raise not_found(f"key {key_id}")
        return {"key": key_view(cp.accounts.revoke(key_id))}

    @v1.get("/account", tags=["accounts"], response_model=SA.AccountPlan, responses=S.errors(404))
    def my_account(account: str | None = Query(None, description="another account's (admin)"),
                   who: Principal = Who) -> dict[str, Any]:
        """The key's account (the admin may name another), its plan, and what it uses now."""
        account_id = _visible_account(who, account or who.account_id)
        return {"account": account_view(cp.accounts.get_account(account_id)), **cp.account_plan(account_id)}

    @v1.get("/plans", tags=["accounts"], response_model=SA.PlanList, responses=S.errors())
    def list_plans() -> dict[str, Any]:
        """The server's plan table, cheapest first."""
        return {"plans": [p.view() for p in cp.plans.values()]}

    @v1.get("/usage", tags=["accounts"], response_model=SA.Usage, responses=S.errors(400, 404))
    def usage(
        from_: str | None = Query(None, alias="from", max_length=64, pattern=WHEN_PATTERN,
                                  description="start: a date or ISO time (UTC); default the start of this month (a "
                                  "sandbox's: its beginning)"),
        to: str | None = Query(None, max_length=64, pattern=WHEN_PATTERN, description="end (exclusive; default "
                               "now)"),
        by: str | None = Query(None, pattern="^(sandbox|size|day)$", description="group by sandbox, size or day"),
        account: str | None = Query(None, description="the admin: one account's (default: every account's)"),
        sandbox: str | None = Query(None, max_length=64, description="only this sandbox's running and stored time"),
        who: Principal = Who,
    ) -> dict[str, Any]:
        """Metered use and cost of the key's account (the admin: every account, or ``account``) between ``from``
        and ``to``: seconds running, GiB-hours running and stored, cost in USD; in total, per size, and per group
        when ``by`` is given (each group split per size). ``sandbox``: one sandbox's (404 if unknown or another
        account's), without its snapshots. A ``to`` before ``from`` is an empty window (zeros)."""
        start, end = parse_when(from_, "from"), parse_when(to, "to")
        if start and end and end < start:  # an empty window: zeros, not an error
            end = start
        scope = _visible_account(who, account) if account else who.scope
        if scope is not None:
            cp.accounts.get_account(scope)
        if sandbox is not None:
            row = cp.store.get_sandbox(sandbox)
            if row is None or not who.sees(row.account_id):
                raise not_found(f"sandbox {sandbox}")
        return {"account": scope, **cp.meter.usage(scope, start, end, by, sandbox)}
