"""Accounts and API keys (issue 12).

An account owns sandboxes, snapshots (and through its sandboxes their routes, jobs and events) and usage records,
and has a plan (:mod:`sbx.control.accounts.plans`). It has named API keys: a key is ``sbx_`` + 43 random URL-safe
characters, shown once when made; the database keeps only its sha256 and its first 8 characters (``prefix``, to
tell keys apart). A key may expire (``expires_at``) and may be revoked; either way it then answers 401.

The installation has one admin key: the token in ``<state_dir>/token`` that ``sbx server`` writes to the client
config on the first start. It belongs to the first account, ``acct_default`` (plan ``unlimited``, made by migration
0005), and may see and act on every account's resources and manage accounts and keys. It cannot be revoked
through the API.

An account ends (issue 36) through ``state``: ``active``; ``suspended`` (its keys answer 403
``account_suspended``, its sandboxes may not start: :meth:`Accounts.require_active`; ``resume`` lifts it);
``deleting`` then ``deleted`` (its keys are removed at once and answer 401; its row stays, so its usage records
keep a name in the admin's report). What happens to its sandboxes is :mod:`sbx.control.cluster.accountend`. The
first account, :data:`DEFAULT_ACCOUNT`, can be neither suspended nor deleted (403 ``protected_account``).

The request's identity is a :class:`Principal` (account id, key id, admin flag); the API's auth dependency yields
it (:func:`sbx.api.auth.principal`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Boolean, DateTime, String, delete, select
from sqlalchemy.orm import Mapped, mapped_column

from sbx.control.accounts.sshkeys import SshKeyRow
from sbx.control.errors import ControlError, not_found
from sbx.control.store.database import Base, Store, as_utc, iso, utcnow
from sbx.control.store.ids import new_id

DEFAULT_ACCOUNT = "acct_default"
"""The installation's first account (migration 0005); the admin key and rows from before accounts belong to it."""
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
KEY_EXPIRY_MAX = 10 * 365 * 86400
ACCOUNT_STATES = ("active", "suspended", "deleting", "deleted")
"""``accounts.state`` (migration 0013): see the module docstring."""
ENDED = frozenset({"deleting", "deleted"})


class AccountRow(Base):
    """An account: ``id`` (``acct_...``), unique ``name``, ``plan`` name, ``state`` (:data:`ACCOUNT_STATES`) and
    ``state_changed_at`` (None until its first suspend or delete)."""

    __tablename__ = "accounts"

    id: Mapped[str] = mapped_column(String(24), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    plan: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    state: Mapped[str] = mapped_column(String(16), default="active")
    state_changed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class ApiKeyRow(Base):
    """An API key: ``secret_sha256`` of the token (never the token), its ``prefix``, ``admin``, ``expires_at`` and
    ``revoked_at`` (None while valid)."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(24), primary_key=True)
    account_id: Mapped[str] = mapped_column(String(24), index=True)
    name: Mapped[str] = mapped_column(String(100))
    secret_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


@dataclass(frozen=True)
class Principal:
    """Who makes a request: ``account_id`` (whose resources it sees and where what it creates goes), ``key_id``,
    and ``admin`` (the installation's key: sees every account)."""

    account_id: str
    key_id: str
    admin: bool = False

    def sees(self, account_id: str | None) -> bool:
        """Whether a resource owned by ``account_id`` exists for this principal."""
        return self.admin or account_id == self.account_id

    @property
    def scope(self) -> str | None:
        """The account to filter lists on: None (all) for the admin, else its own."""
        return None if self.admin else self.account_id


def suspended(account_id: str) -> ControlError:
    """403 ``account_suspended``: the account's keys and starts are refused until an admin resumes it."""
    return ControlError("account_suspended", f"account {account_id} is suspended: its API keys and sandboxes are "
                        "refused until the installation's admin resumes it (sbx admin account resume)", 403)


def deleted(account_id: str, state: str) -> ControlError:
    """409 ``account_deleted``: the account is being deleted or deleted (``state``)."""
    return ControlError("account_deleted", f"account {account_id} is {state}", 409)


def digest(token: str) -> str:
    """sha256 hex of a key's token: what the database keeps."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh API key token: ``sbx_`` + 43 URL-safe characters (256 random bits)."""
    return "sbx_" + secrets.token_urlsafe(32)


def account_view(row: AccountRow) -> dict[str, Any]:
    """API shape: ``{id, name, plan, createdAt, state, stateChangedAt}``."""
    return {"id": row.id, "name": row.name, "plan": row.plan, "createdAt": iso(row.created_at),
            "state": row.state or "active", "stateChangedAt": iso(row.state_changed_at)}


def key_view(row: ApiKeyRow, token: str | None = None) -> dict[str, Any]:
    """API shape: ``{id, account, name, prefix, admin, createdAt, expiresAt, revokedAt}`` (+ ``token`` once)."""
    out: dict[str, Any] = {"id": row.id, "account": row.account_id, "name": row.name, "prefix": row.prefix,
                           "admin": bool(row.admin), "createdAt": iso(row.created_at),
                           "expiresAt": iso(row.expires_at), "revokedAt": iso(row.revoked_at)}
    if token is not None:
        out["token"] = token
    return out


class Accounts:
    """Accounts and keys in ``store``; ``plans`` the known plan names (a new account's plan must be one)."""

    def __init__(self, store: Store, plans: list[str], default_plan: str = "trial"):
        self.store = store
        self.plans = plans
        self.default_plan = default_plan

    def bootstrap(self, admin_token: str) -> None:
        """Make sure ``admin_token`` (the installation's token file) is an admin key of the first account."""
        with self.store.session() as s, s.begin():
            if s.get(AccountRow, DEFAULT_ACCOUNT) is None:
                s.add(AccountRow(id=DEFAULT_ACCOUNT, name="default", plan="unlimited", created_at=utcnow()))
            if s.scalar(select(ApiKeyRow.id).where(ApiKeyRow.secret_sha256 == digest(admin_token))) is None:
                s.add(ApiKeyRow(id=new_id("key_"), account_id=DEFAULT_ACCOUNT, name="admin",
                                secret_sha256=digest(admin_token), prefix=admin_token[:8], admin=True,
                                created_at=utcnow()))

    def authenticate(self, token: str) -> Principal | None:
        """The principal of ``token``, or None when it is no key, revoked or expired, or its account is being
        deleted or deleted. Raises 403 ``account_suspended`` for a key of a suspended account."""
        with self.store.session() as s:
            found = s.execute(select(ApiKeyRow, AccountRow.state).join(
                AccountRow, AccountRow.id == ApiKeyRow.account_id, isouter=True).where(
                ApiKeyRow.secret_sha256 == digest(token))).first()
        if found is None:
            return None
        key, state = found
        if key.revoked_at is not None or state in ENDED:
            return None
        if key.expires_at is not None and as_utc(key.expires_at) <= utcnow():
            return None
        if state == "suspended":
            raise suspended(key.account_id)
        return Principal(key.account_id, key.id, bool(key.admin))

    # accounts ----------------------------------------------------------------------------------------------------
    def _check_plan(self, plan: str) -> None:
        if plan not in self.plans:
            raise ControlError("invalid_plan", f"unknown plan {plan!r}; use one of: {', '.join(self.plans)}", 400,
                               field="plan")

    def create_account(self, name: str, plan: str | None = None) -> tuple[AccountRow, ApiKeyRow, str]:
        """A new account named ``name`` on ``plan`` (default: the server's ``default_plan``) with a first key
        named ``default``; returns ``(account, key, token)`` (the token is not kept). Raises 400 ``invalid_name``
        / ``invalid_plan``, 409 ``account_exists``."""
        if not _NAME_RE.match(name or ""):
            raise ControlError("invalid_name", "account names are 1-63 letters, digits, '.', '_' or '-', starting "
                               "with a letter or digit", 400, field="name")
        plan = plan or self.default_plan
        self._check_plan(plan)
        with self.store.session() as s, s.begin():
            held = s.scalar(select(AccountRow).where(AccountRow.name == name))
            if held is not None and held.state in ENDED:
                raise ControlError("account_exists", f"an account named {name!r} existed ({held.id}, {held.state}); "
                                   "its name stays with its usage records: pick another", 409)
            if held is not None:
                raise ControlError("account_exists", f"an account named {name!r} already exists", 409)
            row = AccountRow(id=new_id("acct_"), name=name, plan=plan, created_at=utcnow())
            s.add(row)
        key, token = self.create_key(row.id, "default")
        return row, key, token

    def get_account(self, account_id: str) -> AccountRow:
        """The account; 404 ``not_found``."""
        with self.store.session() as s:
            row = s.get(AccountRow, account_id)
        if row is None:
            raise not_found(f"account {account_id}")
        return row

    def list_accounts(self) -> list[AccountRow]:
        """Every account, oldest first."""
        with self.store.session() as s:
            return list(s.scalars(select(AccountRow).order_by(AccountRow.created_at)))

    def require_active(self, account_id: str) -> AccountRow:
        """The account, when it may start sandboxes. Raises 403 ``account_suspended``, 409 ``account_deleted``
        (deleting or deleted), 404."""
        row = self.get_account(account_id)
        if row.state == "suspended":
            raise suspended(account_id)
        if row.state in ENDED:
            raise deleted(account_id, row.state)
        return row

    def set_state(self, account_id: str, state: str, allowed_from: tuple[str, ...]) -> tuple[AccountRow, str]:
        """Move the account to ``state`` when it is in one of ``allowed_from`` (or already there: nothing
        changes); returns ``(row, the state it was in)``. Entering ``deleting`` removes its keys (API and SSH) in the
        same transaction, so they answer 401 from then on. Raises 404, 403 ``protected_account`` (the first account),
        409 ``account_deleted`` (from another state)."""
        if state not in ACCOUNT_STATES:
            raise ValueError(state)
        if account_id == DEFAULT_ACCOUNT:
            raise ControlError("protected_account", "the installation's first account (the admin key's) cannot be "
                               "suspended or deleted", 403)
        with self.store.session() as s, s.begin():
            row = s.get(AccountRow, account_id)
            if row is None:
                raise not_found(f"account {account_id}")
            old = row.state or "active"
            if old != state:
                if old not in allowed_from:
                    raise deleted(account_id, old)
                row.state, row.state_changed_at = state, utcnow()
            if state == "deleting":
                s.execute(delete(ApiKeyRow).where(ApiKeyRow.account_id == account_id))
                s.execute(delete(SshKeyRow).where(SshKeyRow.account_id == account_id))  # the SSH gateway's too
        return row, old

    def list_in_state(self, state: str) -> list[AccountRow]:
        """Accounts in ``state``, oldest first (at start: deletions a killed server did not finish)."""
        with self.store.session() as s:
            return list(s.scalars(select(AccountRow).where(AccountRow.state == state)
                                  .order_by(AccountRow.created_at)))

    def set_plan(self, account_id: str, plan: str) -> AccountRow:
        """Move the account to ``plan``. Raises 400 ``invalid_plan``, 404."""
        self._check_plan(plan)
        with self.store.session() as s, s.begin():
            row = s.get(AccountRow, account_id)
            if row is None:
                raise not_found(f"account {account_id}")
            row.plan = plan
        return row

    # keys ----------------------------------------------------------------------------------------------------------
    def create_key(self, account_id: str, name: str, expires_in: int | None = None) -> tuple[ApiKeyRow, str]:
        """A new key for the account, expiring ``expires_in`` seconds from now (None: never); returns ``(row,
        token)``. Raises 400 ``invalid_name``/``invalid_expires_in``, 404 for an unknown account."""
        if not name or not name.strip() or len(name) > 100:
            raise ControlError("invalid_name", "key names are 1-100 characters", 400, field="name")
        if expires_in is not None and not 1 <= expires_in <= KEY_EXPIRY_MAX:
            raise ControlError("invalid_expires_in", f"expiresIn is 1-{KEY_EXPIRY_MAX} seconds", 400,
                               field="expiresIn")
        if self.get_account(account_id).state in ENDED:
            raise deleted(account_id, "deleted")
        token = new_token()
        now = utcnow()
        row = ApiKeyRow(id=new_id("key_"), account_id=account_id, name=name, secret_sha256=digest(token),
                        prefix=token[:8], admin=False, created_at=now,
                        expires_at=now + dt.timedelta(seconds=expires_in) if expires_in else None)
        with self.store.session() as s, s.begin():
            s.add(row)
        return row, token

    def list_keys(self, account_id: str | None = None) -> list[ApiKeyRow]:
        """Keys (of one account when given), oldest first."""
        with self.store.session() as s:
            q = select(ApiKeyRow).order_by(ApiKeyRow.created_at)
            if account_id is not None:
                q = q.where(ApiKeyRow.account_id == account_id)
            return list(s.scalars(q))

    def get_key(self, key_id: str) -> ApiKeyRow:
        """The key row; 404 ``not_found``."""
        with self.store.session() as s:
            row = s.get(ApiKeyRow, key_id)
        if row is None:
            raise not_found(f"key {key_id}")
        return row

    def revoke(self, key_id: str) -> ApiKeyRow:
        """Revoke a key (from now on it answers 401); revoking again is a no-op. Raises 404, 403
        ``protected_key`` for the installation's admin key (rotate ``<state_dir>/token`` instead)."""
        with self.store.session() as s, s.begin():
            row = s.get(ApiKeyRow, key_id)
            if row is None:
                raise not_found(f"key {key_id}")
            if row.admin:
                raise ControlError("protected_key", "the installation's admin key cannot be revoked through the "
                                   "API; replace <state_dir>/token and restart the server instead", 403)
            if row.revoked_at is None:
                row.revoked_at = utcnow()
        return row
