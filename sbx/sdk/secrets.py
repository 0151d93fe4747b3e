"""SDK calls for secrets and their bindings to sandboxes (the credential proxy), sans-IO like
:mod:`sbx.sdk.protocol`: drive them with ``Client.run`` / ``AsyncClient.run``.

>>> from sbx.sdk import Client, secrets
>>> with Client() as c:
...     c.run(secrets.put_secret("gh", "ghp_...", [{"hosts": ["api.github.com"], "action": "bearer"}]))
"""

from __future__ import annotations

from typing import Any

from sbx.sdk.protocol import Call, Request


def put_secret(name: str, value: str, rules: list[dict[str, Any]] | None = None) -> Call:
    """``PUT /v1/secrets/{name}``: create (``rules`` required) or rotate; returns the secret dict (no value)."""
    body: dict[str, Any] = {"value": value}
    if rules is not None:
        body["rules"] = rules
    resp = yield Request("PUT", f"/v1/secrets/{name}", body)
    return dict(resp.body["secret"])


def secrets() -> Call:
    """``GET /v1/secrets``; returns the secret dicts by name."""
    resp = yield Request("GET", "/v1/secrets")
    return list(resp.body["secrets"])


def delete_secret(name: str) -> Call:
    """``DELETE /v1/secrets/{name}``."""
    yield Request("DELETE", f"/v1/secrets/{name}")
    return None


def secret_log(name: str, limit: int = 100) -> Call:
    """``GET /v1/secrets/{name}/log``; returns the use dicts, oldest first."""
    resp = yield Request("GET", f"/v1/secrets/{name}/log", params={"limit": limit})
    return list(resp.body["uses"])


def bind_secret(sandbox_id: str, name: str, bind: bool = True) -> Call:
    """``PUT`` (bind) or ``DELETE`` (unbind) ``/v1/sandboxes/{id}/secrets/{name}``; returns the bound names."""
    resp = yield Request("PUT" if bind else "DELETE", f"/v1/sandboxes/{sandbox_id}/secrets/{name}")
    return list(resp.body["secrets"])
