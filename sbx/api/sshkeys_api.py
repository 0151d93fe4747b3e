"""The SSH key routes (issue 35): the public keys the SSH gateway (:mod:`sbx.api.sshgateway`) lets in::

    POST   /v1/ssh-keys[?account=]     register a public key          201 {"sshKey"}
    GET    /v1/ssh-keys[?account=]     the account's keys             200 {"sshKeys": [...]}
    DELETE /v1/ssh-keys/{id}           delete one                     200 {"deleted": id}

A key belongs to the account of the API key that registered it (the admin may name another with ``?account=``;
the admin's list without it shows every account's) and opens that account's sandboxes only. Errors: 400
``invalid_ssh_key`` (not one public key, a private key, an unaccepted type) / ``invalid_name``, 403 ``admin_only``
(``?account=`` without the admin key), 404 ``not_found`` (an unknown key or account, or another account's key),
409 ``ssh_key_exists`` (the account has this key already). An error changes nothing.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field

from sbx.api import schemas as S
from sbx.api.auth import principal, require_admin
from sbx.api.schemas import Out
from sbx.control.accounts.keys import Principal
from sbx.control.accounts.sshkeys import MAX_KEY_TEXT, SshKeys, key_view
from sbx.control.service import ControlPlane


class AddSshKey(BaseModel):
    """``POST /v1/ssh-keys``: ``publicKey``, one OpenSSH public key line (the ``.pub`` file); ``name``
    (default: the key's comment, else its type)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    publicKey: str = Field(description="an OpenSSH public key: 'ssh-ed25519 AAAA... comment' (at most "
                           f"{MAX_KEY_TEXT} characters; anything else is 400 invalid_ssh_key)")
    name: str | None = Field(None, min_length=1, max_length=100)


class SshKey(Out):
    """A registered SSH public key; ``fingerprint`` as ``ssh-keygen -l`` prints it (``SHA256:...``)."""

    id: str
    account: str
    name: str
    algorithm: str
    fingerprint: str
    publicKey: str
    createdAt: str


class SshKeyOut(Out):
    sshKey: SshKey


class SshKeyList(Out):
    sshKeys: list[SshKey]


class SshKeyDeleted(Out):
    deleted: str


def register(v1: APIRouter, cp: ControlPlane) -> None:
    """Add the SSH key routes to ``v1`` (the authenticated ``/v1`` router)."""
    Who = Depends(principal)
    keys = SshKeys(cp.store)

    def account_of(who: Principal, account: str | None) -> str:
        if account is None or account == who.account_id:
            return who.account_id
        require_admin(who)
        return cp.accounts.get_account(account).id  # 404 for an unknown account

    @v1.post("/ssh-keys", status_code=201, tags=["ssh"], response_model=SshKeyOut,
             responses=S.errors(400, 403, 404, 409))
    def add_ssh_key(body: AddSshKey, account: str | None = Query(None, description="another account's (admin)"),
                    who: Principal = Who) -> dict[str, Any]:
        """Register an SSH public key: from now on it logs in through the SSH gateway (``ssh <sandbox id>@host -p
        2222``) to the account's sandboxes, and to no other account's."""
        acct = account_of(who, account)
        cp.accounts.require_active(acct)
        return {"sshKey": key_view(keys.add(acct, body.publicKey, body.name))}

    @v1.get("/ssh-keys", tags=["ssh"], response_model=SshKeyList, responses=S.errors(403, 404))
    def list_ssh_keys(account: str | None = Query(None, description="one account's (admin; default: the admin "
                                                  "sees every account's)"), who: Principal = Who) -> dict[str, Any]:
        """The account's SSH public keys, oldest first."""
        acct = who.scope if account is None else account_of(who, account)
        return {"sshKeys": [key_view(r) for r in keys.of_account(acct)]}

    @v1.delete("/ssh-keys/{key_id}", tags=["ssh"], response_model=SshKeyDeleted, responses=S.errors(404))
    def delete_ssh_key(key_id: str, who: Principal = Who) -> dict[str, Any]:
        """Delete an SSH key: the gateway refuses it from the next login on (open sessions stay)."""
        keys.remove(who.scope, key_id)
        return {"deleted": key_id}
