"""SDK calls for accounts, API keys, plans and usage (issue 12), sans-IO like :mod:`sbx.sdk.protocol`: drive them
with ``Client.run`` / ``AsyncClient.run``.

>>> from sbx.sdk import Client
>>> from sbx.sdk import accounts
>>> with Client() as c:
...     c.run(accounts.usage(by="day"))["total"]["cost"]
"""

from __future__ import annotations

from typing import Any

from sbx.sdk.protocol import Call, Request


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def create_account(name: str, plan: str | None = None) -> Call:
    """``POST /v1/accounts`` (admin key); returns ``{"account", "key"}``, the key with its ``token`` (shown once)."""
    resp = yield Request("POST", "/v1/accounts", _clean({"name": name, "plan": plan}))
    return dict(resp.body)


def list_accounts() -> Call:
    """``GET /v1/accounts`` (admin key); returns account dicts."""
    resp = yield Request("GET", "/v1/accounts")
    return list(resp.body["accounts"])


def set_plan(account_id: str, plan: str) -> Call:
    """``PATCH /v1/accounts/{id}`` (admin key); returns the account dict."""
    resp = yield Request("PATCH", f"/v1/accounts/{account_id}", {"plan": plan})
    return dict(resp.body["account"])


def suspend_account(account_id: str) -> Call:
    """``POST /v1/accounts/{id}/suspend`` (admin key); returns ``{"account", "sandboxes"}`` (those being stopped)."""
    resp = yield Request("POST", f"/v1/accounts/{account_id}/suspend")
    return dict(resp.body)


def resume_account(account_id: str) -> Call:
    """``POST /v1/accounts/{id}/resume`` (admin key); returns the account dict (``state`` ``active``)."""
    resp = yield Request("POST", f"/v1/accounts/{account_id}/resume")
    return dict(resp.body["account"])


def delete_account(account_id: str) -> Call:
    """``DELETE /v1/accounts/{id}`` (admin key); returns ``{"account", "sandboxes"}`` (the account ``deleting``,
    the sandboxes being deleted); poll :func:`account` until its ``state`` is ``deleted``."""
    resp = yield Request("DELETE", f"/v1/accounts/{account_id}")
    return dict(resp.body)


def create_key(account_id: str, name: str = "default", expires_in: int | None = None) -> Call:
    """``POST /v1/accounts/{id}/keys``; returns the key dict with its ``token`` (shown once)."""
    resp = yield Request("POST", f"/v1/accounts/{account_id}/keys", _clean({"name": name, "expiresIn": expires_in}))
    return dict(resp.body["key"])


def list_keys(account_id: str) -> Call:
    """``GET /v1/accounts/{id}/keys``; returns key dicts (no tokens)."""
    resp = yield Request("GET", f"/v1/accounts/{account_id}/keys")
    return list(resp.body["keys"])


def revoke_key(key_id: str) -> Call:
    """``DELETE /v1/keys/{id}``; returns the revoked key dict."""
    resp = yield Request("DELETE", f"/v1/keys/{key_id}")
    return dict(resp.body["key"])


def account(account_id: str | None = None) -> Call:
    """``GET /v1/account``; returns ``{"account", "plan", "used"}`` of the key's account (or ``account_id``)."""
    resp = yield Request("GET", "/v1/account", None, _clean({"account": account_id}))
    return dict(resp.body)


def plans() -> Call:
    """``GET /v1/plans``; returns plan dicts, cheapest first."""
    resp = yield Request("GET", "/v1/plans")
    return list(resp.body["plans"])


def usage(start: str | None = None, end: str | None = None, by: str | None = None, account_id: str | None = None,
          sandbox_id: str | None = None) -> Call:
    """``GET /v1/usage``; ``start``/``end`` dates or ISO times (UTC), ``by`` ``sandbox``/``size``/``day``. Returns
    the report dict (``total``, ``bySize``, ``groups``; seconds, GiB-hours, cost in USD)."""
    params = _clean({"from": start, "to": end, "by": by, "account": account_id, "sandbox": sandbox_id})
    resp = yield Request("GET", "/v1/usage", None, params)
    return dict(resp.body)
