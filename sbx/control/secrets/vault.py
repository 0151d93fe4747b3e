"""Secrets for the credential proxy: values stored encrypted, bound to sandboxes, injected on the way out.

A sandbox never holds a secret. It sends a placeholder (``sbx-secret:NAME``) or nothing, and the node's egress
proxy (:mod:`sbx.node.network.egressproxy`) asks :meth:`Secrets.resolve` what to do with each request: a secret's
**rules** name the hosts it may go to (exact ``api.example.com`` or ``*.example.com``, which matches any
subdomain but not ``example.com`` itself), optionally a path prefix and methods, and one **action**:

- ``header``: set header ``header`` to ``value`` with ``{secret}`` replaced (``Authorization: Bearer {secret}``);
- ``basic``: set ``Authorization: Basic base64(username:secret)``;
- ``replace``: replace the placeholder ``sbx-secret:NAME`` in headers, query and a body of at most 1 MiB.

A request that no rule of a bound secret names gets nothing: its placeholder passes unchanged.

At rest, values are AES-256-GCM ciphertext (``cryptography``'s AEAD) with a 96-bit random nonce, bound to
``account/name/version`` as associated data, under a key kept outside the database: ``<state_dir>/secrets.key``
(32 random bytes, mode 0600, made on first use). A database dump alone reveals names and rules, never values.
Each injection is recorded in ``secret_uses`` (time, sandbox, host, method, path, status): :meth:`Secrets.log`.
A new value (:meth:`Secrets.put` again) takes effect on the next request: the proxy asks for every request.

Secrets belong to an account (``account_id``, given by the API layer). Errors are :class:`ControlError`.
"""

from __future__ import annotations

import base64
import datetime as dt
import os
import secrets as _random
import threading
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from sqlalchemy import JSON, DateTime, Integer, String, Text, delete, select
from sqlalchemy.orm import Mapped, mapped_column

from sbx.control.errors import ControlError, not_found
from sbx.control.secrets.nodes import SecretNodes, SecretsPlane
from sbx.control.secrets.rules import (
    PLACEHOLDER_PREFIX,
    VALUE_MAX_BYTES,
    bad_rules,
    check_name,
    normalise_rules,
    rule_matches,
    utf8,
)
from sbx.control.store.database import Base, iso, utcnow
from sbx.node.types import NodeError


class SecretRow(Base):
    """A secret: ``ciphertext`` is ``base64(nonce + AES-GCM ciphertext)``; ``rules`` the list of rule dicts
    (:func:`normalise_rules`); ``version`` grows with each new value."""

    __tablename__ = "secrets"

    id: Mapped[str] = mapped_column(String(24), primary_key=True)
    account_id: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(64))
    ciphertext: Mapped[str] = mapped_column(Text)
    rules: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class BindingRow(Base):
    """Sandbox ``sandbox_id`` may use secret ``secret_id``."""

    __tablename__ = "secret_bindings"

    sandbox_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    secret_id: Mapped[str] = mapped_column(String(24), primary_key=True)
    account_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class UseRow(Base):
    """One request the proxy injected secret ``secret_id`` into; ``status`` is the upstream's HTTP status (None
    when the upstream never answered)."""

    __tablename__ = "secret_uses"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    secret_id: Mapped[str] = mapped_column(String(24), index=True)
    account_id: Mapped[str] = mapped_column(String(64))
    sandbox_id: Mapped[str] = mapped_column(String(16))
    at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    host: Mapped[str] = mapped_column(String(255))
    method: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(Text)
    status: Mapped[int | None] = mapped_column(Integer, nullable=True)


def load_key(path: Path) -> bytes:
    """The 32-byte key at ``path``, made (random, mode 0600, parent 0700) when missing. The file is created with
    ``O_EXCL`` so two starting servers can't write two keys; a short or unreadable file raises ``OSError``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            data = path.read_bytes()
        else:
            key = _random.token_bytes(32)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
                f.flush()
                os.fsync(f.fileno())
            return key
    if len(data) != 32:
        raise OSError(f"{path}: a secrets key is 32 bytes, this file holds {len(data)}")
    return data


def _aad(account_id: str, name: str, version: int) -> bytes:
    return f"{account_id}/{name}/{version}".encode()


def seal(key: bytes, value: str, aad: bytes) -> str:
    """``base64(nonce + ciphertext)`` of ``value`` under ``key`` (AES-256-GCM, random 96-bit nonce)."""
    nonce = _random.token_bytes(12)
    return base64.b64encode(nonce + AESGCM(key).encrypt(nonce, value.encode(), aad)).decode()


def unseal(key: bytes, blob: str, aad: bytes) -> str:
    """The value :func:`seal` sealed; raises ``cryptography.exceptions.InvalidTag`` when key, data or ``aad``
    differ."""
    raw = base64.b64decode(blob)
    return AESGCM(key).decrypt(raw[:12], raw[12:], aad).decode()


class Secrets:
    """Secrets, bindings and their audit for one control plane (``cp``): the store, the key at
    ``<state_dir>/secrets.key``, and the node, which learns which sandboxes to send through its egress proxy
    (``node.set_egress_proxy``)."""

    def __init__(self, cp: SecretsPlane):
        self.cp = cp
        self.store = cp.store
        self._key: bytes | None = None
        self._key_lock = threading.Lock()
        self.nodes = SecretNodes(self)  # which node may ask about which sandbox; per-node sync

    @property
    def key(self) -> bytes:
        with self._key_lock:
            if self._key is None:
                self._key = load_key(self.cp.settings.state_dir / "secrets.key")
            return self._key

    # views -----------------------------------------------------------------------------------------------------
    def view(self, row: SecretRow) -> dict[str, Any]:
        """API shape (never the value): name, version, rules (camelCase), placeholder, sandboxes bound, times."""
        with self.store.session() as s:
            bound = list(s.scalars(select(BindingRow.sandbox_id).where(BindingRow.secret_id == row.id)
                                   .order_by(BindingRow.created_at)))
        return {
            "name": row.name,
            "version": row.version,
            "placeholder": PLACEHOLDER_PREFIX + row.name,
            "rules": [{"hosts": r["hosts"], "pathPrefix": r.get("path_prefix"), "methods": r.get("methods") or [],
                       "action": r["action"], "header": r.get("header"), "value": r.get("value"),
                       "username": r.get("username")} for r in row.rules],
            "sandboxes": bound,
            "createdAt": iso(row.created_at),
            "updatedAt": iso(row.updated_at),
        }

    def _row(self, account_id: str, name: str) -> SecretRow:
        with self.store.session() as s:
            row = s.scalar(select(SecretRow).where(SecretRow.account_id == account_id, SecretRow.name == name))
        if row is None:
            raise not_found(f"secret {name}")
        return row

    # secrets ---------------------------------------------------------------------------------------------------
    def put(self, account_id: str, name: str, value: str, rules: list[dict[str, Any]] | None) -> SecretRow:
        """Create secret ``name`` or give it a new ``value`` (rotation: version + 1, in effect for the next proxied
        request). ``rules`` replace the old ones when given; a new secret needs at least one. Raises 400
        ``invalid_name`` / ``invalid_value`` (empty, over :data:`VALUE_MAX_BYTES`, NUL) / ``invalid_rules``, 404
        ``not_found`` for a value without rules when the secret does not exist."""
        check_name(name)
        if not value or not utf8(value) or len(value.encode()) > VALUE_MAX_BYTES or "\0" in value:
            raise ControlError("invalid_value", f"a secret value is 1 to {VALUE_MAX_BYTES} bytes without NUL", 400,
                               field="value")
        norm = normalise_rules(rules) if rules is not None else None
        now = utcnow()
        with self.store.session() as s, s.begin():
            row = s.scalar(select(SecretRow).where(SecretRow.account_id == account_id, SecretRow.name == name))
            if row is None:
                if norm is None:  # a rotation of a secret that does not exist
                    raise ControlError("not_found", f"secret {name} not found (a new secret needs rules: --host)",
                                       404)
                if not norm:
                    raise bad_rules("a new secret needs at least one rule naming where it may go (--host)")
                row = SecretRow(id="sec_" + _random.token_hex(8), account_id=account_id, name=name, version=1,
                                rules=norm, created_at=now, updated_at=now,
                                ciphertext=seal(self.key, value, _aad(account_id, name, 1)))
                s.add(row)
            else:
                row.version += 1
                row.ciphertext = seal(self.key, value, _aad(account_id, name, row.version))
                if norm:
                    row.rules = norm
                row.updated_at = now
        return row

    def get(self, account_id: str, name: str) -> SecretRow:
        """The secret row; 404 ``not_found``."""
        return self._row(account_id, name)

    def all(self, account_id: str) -> list[SecretRow]:
        """The account's secrets by name."""
        with self.store.session() as s:
            return list(s.scalars(select(SecretRow).where(SecretRow.account_id == account_id)
                                  .order_by(SecretRow.name)))

    def remove(self, account_id: str, name: str) -> None:
        """Delete the secret, its bindings (the proxy stops injecting it at once) and its audit; 404 if absent."""
        row = self._row(account_id, name)
        with self.store.session() as s, s.begin():
            sandboxes = list(s.scalars(select(BindingRow.sandbox_id).where(BindingRow.secret_id == row.id)))
            s.execute(delete(BindingRow).where(BindingRow.secret_id == row.id))
            s.execute(delete(UseRow).where(UseRow.secret_id == row.id))
            s.execute(delete(SecretRow).where(SecretRow.id == row.id))
        for sid in sandboxes:
            self.sync_node_of(sid)

    # bindings --------------------------------------------------------------------------------------------------
    def names(self, account_id: str, names: list[str]) -> list[SecretRow]:
        """The rows of ``names`` (for create/fork, before anything is made); 404 for the first unknown one, 409
        ``egress_proxy_unavailable`` when no node runs a proxy."""
        if names:
            self.nodes.require()
        return [self._row(account_id, n) for n in dict.fromkeys(names)]

    def bind(self, account_id: str, sandbox_id: str, name: str) -> list[str]:
        """Let sandbox ``sandbox_id`` use secret ``name`` (idempotent); its outbound HTTP(S) goes through the
        node's egress proxy from now on. Returns the sandbox's bound secret names. 404 for either, 409
        ``egress_proxy_unavailable`` when the sandbox's node runs no proxy."""
        self.cp.get(sandbox_id)
        row = self._row(account_id, name)
        self.nodes.require(sandbox_id)
        with self.store.session() as s, s.begin():
            if s.get(BindingRow, (sandbox_id, row.id)) is None:
                s.add(BindingRow(sandbox_id=sandbox_id, secret_id=row.id, account_id=account_id,
                                 created_at=utcnow()))
        self.sync_node_of(sandbox_id)
        return self.bound(account_id, sandbox_id)

    def unbind(self, account_id: str, sandbox_id: str, name: str) -> list[str]:
        """Take secret ``name`` away from the sandbox (the next request no longer gets it); a sandbox left with no
        binding leaves the proxy (end-to-end TLS again). 404 when the sandbox, the secret or the binding is
        unknown."""
        self.cp.get(sandbox_id)
        row = self._row(account_id, name)
        with self.store.session() as s, s.begin():
            found = s.get(BindingRow, (sandbox_id, row.id))
            if found is None:
                raise not_found(f"binding of secret {name} to {sandbox_id}")
            s.delete(found)
        self.sync_node_of(sandbox_id)
        return self.bound(account_id, sandbox_id)

    def bound(self, account_id: str, sandbox_id: str) -> list[str]:
        """Names of the secrets bound to the sandbox, sorted."""
        with self.store.session() as s:
            q = (select(SecretRow.name).join(BindingRow, BindingRow.secret_id == SecretRow.id)
                 .where(BindingRow.sandbox_id == sandbox_id, SecretRow.account_id == account_id)
                 .order_by(SecretRow.name))
            return list(s.scalars(q))

    def forget_sandbox(self, sandbox_id: str) -> None:
        """Drop a deleted sandbox's bindings (its audit stays)."""
        with self.store.session() as s, s.begin():
            s.execute(delete(BindingRow).where(BindingRow.sandbox_id == sandbox_id))
        self.sync_node_of(sandbox_id)

    def has_bindings(self, sandbox_id: str) -> bool:
        """True when at least one secret is bound to the sandbox."""
        with self.store.session() as s:
            return s.scalar(select(BindingRow.secret_id).where(BindingRow.sandbox_id == sandbox_id)) is not None

    def bound_sandboxes(self) -> list[str]:
        """Every sandbox with at least one binding, sorted."""
        with self.store.session() as s:
            return sorted(set(s.scalars(select(BindingRow.sandbox_id))))

    def sync_node_of(self, sandbox_id: str) -> None:
        """Tell the sandbox's node (the store's) whether it goes through the egress proxy. Raises 409
        ``egress_proxy_unavailable`` (that node runs none), 502 for other node errors."""
        try:
            self.cp.node.set_egress_proxy(sandbox_id, self.has_bindings(sandbox_id))
        except NodeError as e:
            raise ControlError(e.code, e.message, 409 if e.code == "egress_proxy_unavailable" else 502) from e

    def sync_all(self) -> None:
        """Tell every node its sandboxes with a binding (:meth:`sbx.control.secrets.nodes.SecretNodes.sync_all`)."""
        self.nodes.sync_all()

    # the proxy's questions -------------------------------------------------------------------------------------
    def resolve(self, sandbox_id: str, host: str, method: str, path: str) -> list[dict[str, Any]]:
        """What the egress proxy does to a request of ``sandbox_id`` to ``host`` (the TLS server name the
        upstream's certificate was checked against, or for plain HTTP a Host the destination address resolves
        to): for each bound secret with a rule naming the request, ``{"secret": name, "action", "header"?,
        "value": the text to insert}`` (``header``: the template filled in; ``basic``: the ``Basic ...``
        credentials; ``replace``: ``placeholder`` and the value). ``[]`` when nothing applies."""
        out: list[dict[str, Any]] = []
        with self.store.session() as s:
            q = (select(SecretRow).join(BindingRow, BindingRow.secret_id == SecretRow.id)
                 .where(BindingRow.sandbox_id == sandbox_id).order_by(SecretRow.name))
            rows = list(s.scalars(q))
        for row in rows:
            rule = next((r for r in row.rules if rule_matches(r, host, method, path)), None)
            if rule is None:
                continue
            value = unseal(self.key, row.ciphertext, _aad(row.account_id, row.name, row.version))
            if rule["action"] == "header":
                out.append({"secret": row.name, "action": "header", "header": rule["header"],
                            "value": rule["value"].replace("{secret}", value)})
            elif rule["action"] == "basic":
                creds = base64.b64encode(f"{rule['username']}:{value}".encode()).decode()
                out.append({"secret": row.name, "action": "header", "header": "Authorization",
                            "value": f"Basic {creds}"})
            else:
                out.append({"secret": row.name, "action": "replace", "placeholder": PLACEHOLDER_PREFIX + row.name,
                            "value": value})
        return out

    def record(self, sandbox_id: str, names: list[str], host: str, method: str, path: str,
               status: int | None) -> None:
        """Audit one proxied request that carried the bound secrets ``names``."""
        at = utcnow()
        with self.store.session() as s, s.begin():
            q = (select(SecretRow).join(BindingRow, BindingRow.secret_id == SecretRow.id)
                 .where(BindingRow.sandbox_id == sandbox_id, SecretRow.name.in_(names)))
            for row in s.scalars(q):
                s.add(UseRow(secret_id=row.id, account_id=row.account_id, sandbox_id=sandbox_id, at=at,
                             host=host[:255], method=method[:16], path=path[:2048], status=status))

    def log(self, account_id: str, name: str, limit: int = 100) -> list[dict[str, Any]]:
        """The secret's most recent uses, oldest first: ``{at, sandbox, host, method, path, status}``."""
        row = self._row(account_id, name)
        with self.store.session() as s:
            uses = list(s.scalars(select(UseRow).where(UseRow.secret_id == row.id)
                                  .order_by(UseRow.seq.desc()).limit(limit)))
        return [{"at": iso(u.at), "sandbox": u.sandbox_id, "host": u.host, "method": u.method, "path": u.path,
                 "status": u.status} for u in reversed(uses)]

    def handle(self, sandbox_id: str, message: dict[str, Any]) -> dict[str, Any]:
        """One question from the egress proxy (:mod:`sbx.node.network.egressproxy`'s control socket): ``{"op":
        "resolve", host, method, path}`` answers ``{"actions": [...]}``; ``{"op": "used", secrets, host, method,
        path, status}`` records the use and answers ``{}``."""
        op = message.get("op")
        host, method, path = str(message.get("host", "")), str(message.get("method", "")), str(message.get("path", ""))
        if op == "resolve":
            return {"actions": self.resolve(sandbox_id, host, method, path)}
        if op == "used":
            status = message.get("status")
            self.record(sandbox_id, [str(n) for n in message.get("secrets") or []], host, method, path,
                        int(status) if isinstance(status, int) else None)
            return {}
        return {"error": f"unknown op {op!r}"}
