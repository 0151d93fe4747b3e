"""SDK calls for the SSH public keys the SSH gateway lets in (``ssh -p 2222 <sandbox id>@HOST``), sans-IO like
:mod:`sbx.sdk.protocol`: drive them with ``Client.run`` / ``AsyncClient.run``.

>>> from pathlib import Path
>>> from sbx.sdk import Client, sshkeys
>>> with Client() as c:
...     key = c.run(sshkeys.add_ssh_key(Path("~/.ssh/id_ed25519.pub").expanduser().read_text(), name="laptop"))
"""

from __future__ import annotations

from typing import Any

from sbx.sdk.protocol import Call, Request


def add_ssh_key(public_key: str, name: str | None = None, account: str | None = None) -> Call:
    """``POST /v1/ssh-keys``: register ``public_key`` (an OpenSSH public key line) for the key's account (the admin:
    for ``account``); returns ``{id, account, name, algorithm, fingerprint, publicKey, createdAt}``. Errors:
    400 ``invalid_ssh_key``, 409 ``ssh_key_exists``."""
    body: dict[str, Any] = {"publicKey": public_key}
    if name is not None:
        body["name"] = name
    resp = yield Request("POST", "/v1/ssh-keys", body, params={"account": account} if account else {})
    return dict(resp.body["sshKey"])


def ssh_keys(account: str | None = None) -> Call:
    """``GET /v1/ssh-keys``: the account's SSH keys (the admin: every account's, or ``account``'s), oldest
    first."""
    resp = yield Request("GET", "/v1/ssh-keys", params={"account": account} if account else {})
    return list(resp.body["sshKeys"])


def delete_ssh_key(key_id: str) -> Call:
    """``DELETE /v1/ssh-keys/{id}``: the gateway refuses the key from the next login on. 404 ``not_found``."""
    yield Request("DELETE", f"/v1/ssh-keys/{key_id}")
    return None
