"""Response bodies of the account routes (accounts, API keys, plans, usage), the secrets routes and the console's
session routes as pydantic models, for the OpenAPI document; the shared parts are in :mod:`sbx.api.schemas`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sbx.api.schemas import Figures, Out


class Account(Out):
    """An account; ``state``: ``active``, ``suspended`` (keys refused with 403 ``account_suspended``), ``deleting``
    or ``deleted`` (keys gone, 401); ``stateChangedAt`` when it last changed (null until then)."""

    id: str
    name: str
    plan: str
    createdAt: str
    state: Literal["active", "suspended", "deleting", "deleted"] = "active"
    stateChangedAt: str | None = None


class ApiKey(Out):
    """An API key; ``token`` only in the answer that made it (it is stored hashed)."""

    id: str
    account: str
    name: str
    prefix: str
    admin: bool
    createdAt: str
    expiresAt: str | None
    revokedAt: str | None
    token: str | None = None


class AccountList(Out):
    accounts: list[Account]


class AccountCreated(Out):
    account: Account
    key: ApiKey


class AccountOut(Out):
    account: Account


class AccountEnded(Out):
    """The answer of a suspend (``sandboxes``: those being stopped, with memory) or a delete (those being
    deleted; the account is ``deleting`` until the last is gone, then ``deleted``)."""

    account: Account
    sandboxes: list[str]


class KeyOut(Out):
    key: ApiKey


class KeyList(Out):
    keys: list[ApiKey]


class Plan(Out):
    """A plan: ``sizes`` it runs, ``startsPerHour`` (create, resume, fork), ``running`` at once, ``storageGiB``
    included (0 = no limit), ``priceUsdMonth``, the ``runtimes`` (classes) its sandboxes may have."""

    name: str
    priceUsdMonth: float
    sizes: list[str]
    startsPerHour: int
    running: int
    storageGiB: float
    runtimes: list[str]


class PlanList(Out):
    plans: list[Plan]


class PlanUse(Out):
    startsLastHour: int
    running: int
    storedGiB: float


class AccountPlan(Out):
    """``GET /v1/account``: the key's account, its plan and what it uses now."""

    account: Account
    plan: Plan
    used: PlanUse


class UsageGroup(Figures):
    key: str
    bySize: dict[str, Figures]


class Usage(Out):
    """``GET /v1/usage``: totals, totals per size (``storage`` for stored data) and, with ``by``, one group per
    sandbox / size / UTC day, each with its per-size split (what a console plots per day and per size)."""

    account: str | None
    from_: str = Field(alias="from")
    to: str
    by: str | None
    priceModel: str
    currency: str
    total: Figures
    bySize: dict[str, Figures]
    groups: list[UsageGroup]


class SecretRuleOut(Out):
    hosts: list[str]
    pathPrefix: str | None
    methods: list[str]
    action: Literal["replace", "header", "basic"]
    header: str | None
    value: str | None
    username: str | None


class Secret(Out):
    """A secret as the API shows it: never its value. ``placeholder`` is what a sandbox writes where the value
    should go; ``version`` grows with each new value; ``sandboxes`` are the ones bound to it."""

    name: str
    version: int
    placeholder: str
    rules: list[SecretRuleOut]
    sandboxes: list[str]
    createdAt: str
    updatedAt: str


class SecretOut(Out):
    secret: Secret


class SecretList(Out):
    secrets: list[Secret]


class SecretUse(Out):
    """One request the egress proxy put the secret into: ``status`` is the upstream's (null: it never answered)."""

    at: str
    sandbox: str
    host: str
    method: str
    path: str
    status: int | None


class SecretLog(Out):
    uses: list[SecretUse]


class Bindings(Out):
    """The names of the secrets bound to a sandbox."""

    sandbox: str
    secrets: list[str]


class ConsoleSession(Out):
    """A web console session: ``csrf`` goes in the ``X-Sbx-Csrf`` header of every request that changes something;
    ``keyId`` names the key it was opened with, ``account`` its account (``admin``: the installation's key, which
    sees every account); ``expiresAt`` is ISO 8601 UTC."""

    keyId: str
    account: str
    admin: bool
    csrf: str
    expiresAt: str


class ConsoleSessionOut(Out):
    session: ConsoleSession


class SignedOut(Out):
    signedOut: bool
