"""The secrets routes (credential proxy, :mod:`sbx.control.secrets.vault`)::

    PUT    /v1/secrets/{name}                     create, or rotate (new value)   200 {"secret"}
    GET    /v1/secrets                            names and metadata, no values    200 {"secrets": [...]}
    GET    /v1/secrets/{name}                     one                              200 {"secret"}
    DELETE /v1/secrets/{name}                     delete (unbinds everywhere)      200 {"deleted": name}
    GET    /v1/secrets/{name}/log[?limit=N]       its recent uses                  200 {"uses": [...]}
    GET    /v1/sandboxes/{id}/secrets             secrets bound to a sandbox       200 {"sandbox", "secrets"}
    PUT    /v1/sandboxes/{id}/secrets/{name}      bind                             200 {"sandbox", "secrets"}
    DELETE /v1/sandboxes/{id}/secrets/{name}      unbind                           200 {"sandbox", "secrets"}

No answer ever holds a secret's value. Errors: 400 ``invalid_name`` / ``invalid_value`` / ``invalid_rules``,
404 ``not_found``, 409 ``egress_proxy_unavailable`` (binding on a node without its egress proxy).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query

from sbx.api import schemas as S
from sbx.api import schemas_accounts as SA
from sbx.api.auth import principal
from sbx.api.models import SECRET_NAME_PATTERN, PutSecret
from sbx.control.accounts.keys import Principal
from sbx.control.service import ControlPlane

Name = Annotated[str, Path(min_length=1, max_length=63, pattern=SECRET_NAME_PATTERN,
                           description="secret name: a letter, then up to 62 letters, digits, '_' or '-'")]


def register(v1: APIRouter, cp: ControlPlane) -> None:
    """Add the secrets routes to ``v1`` (the authenticated ``/v1`` router). A secret belongs to the account of the
    key that set it; a sandbox's bindings use the sandbox's account (the router's ``owned`` check has already
    answered 404 for another account's sandbox)."""
    Who = Depends(principal)
    sec = cp.secrets

    @v1.put("/secrets/{name}", tags=["secrets"], response_model=SA.SecretOut, responses=S.errors(400, 404))
    def put_secret(name: Name, body: PutSecret, who: Principal = Who) -> dict[str, Any]:
        """Create secret ``name`` (``rules`` required) or give it a new value: the egress proxy uses the new one
        from the next request on, in running sandboxes too. The answer never holds the value."""
        rules = None if body.rules is None else [r.model_dump() for r in body.rules]
        return {"secret": sec.view(sec.put(who.account_id, name, body.value, rules))}

    @v1.get("/secrets", tags=["secrets"], response_model=SA.SecretList, responses=S.errors())
    def list_secrets(who: Principal = Who) -> dict[str, Any]:
        """The account's secrets by name: names, rules, versions and bound sandboxes, never values."""
        return {"secrets": [sec.view(r) for r in sec.all(who.account_id)]}

    @v1.get("/secrets/{name}", tags=["secrets"], response_model=SA.SecretOut, responses=S.errors(400, 404))
    def get_secret(name: Name, who: Principal = Who) -> dict[str, Any]:
        """One secret's metadata."""
        return {"secret": sec.view(sec.get(who.account_id, name))}

    @v1.delete("/secrets/{name}", tags=["secrets"], response_model=S.Deleted, responses=S.errors(400, 404))
    def delete_secret(name: Name, who: Principal = Who) -> dict[str, Any]:
        """Delete a secret with its bindings and audit log; the proxy stops injecting it at once."""
        sec.remove(who.account_id, name)
        return {"deleted": name}

    @v1.get("/secrets/{name}/log", tags=["secrets"], response_model=SA.SecretLog, responses=S.errors(400, 404))
    def secret_log(name: Name, limit: int = Query(100, ge=1, le=10000, description="most recent uses kept"),
                   who: Principal = Who) -> dict[str, Any]:
        """The secret's most recent uses, oldest first: time, sandbox, host, method, path, upstream status."""
        return {"uses": sec.log(who.account_id, name, limit)}

    @v1.get("/sandboxes/{sandbox_id}/secrets", tags=["secrets"], response_model=SA.Bindings,
            responses=S.errors(404))
    def sandbox_secrets(sandbox_id: str) -> dict[str, Any]:
        """Names of the secrets bound to the sandbox."""
        return {"sandbox": sandbox_id, "secrets": sec.bound(cp.get(sandbox_id).account_id, sandbox_id)}

    @v1.put("/sandboxes/{sandbox_id}/secrets/{name}", tags=["secrets"], response_model=SA.Bindings,
            responses=S.errors(400, 404, 409, 502))
    def bind_secret(sandbox_id: str, name: Name) -> dict[str, Any]:
        """Let the sandbox use the secret: its outbound HTTP(S) goes through the egress proxy from its next
        connection on (no restart)."""
        return {"sandbox": sandbox_id, "secrets": sec.bind(cp.get(sandbox_id).account_id, sandbox_id, name)}

    @v1.delete("/sandboxes/{sandbox_id}/secrets/{name}", tags=["secrets"], response_model=SA.Bindings,
               responses=S.errors(400, 404, 409, 502))
    def unbind_secret(sandbox_id: str, name: Name) -> dict[str, Any]:
        """Take the secret away from the sandbox; with no secret left it leaves the proxy."""
        return {"sandbox": sandbox_id, "secrets": sec.unbind(cp.get(sandbox_id).account_id, sandbox_id, name)}


def bind_all(cp: ControlPlane, sandbox_id: str, names: list[str] | None, account_id: str) -> None:
    """Bind ``names`` to a sandbox that was just created or forked (checked beforehand with
    :meth:`sbx.control.secrets.vault.Secrets.names`)."""
    for name in dict.fromkeys(names or []):
        cp.secrets.bind(account_id, sandbox_id, name)
