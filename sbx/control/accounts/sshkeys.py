"""SSH public keys of accounts (issue 35): what the SSH gateway (:mod:`sbx.api.sshgateway`) lets in.

An account registers public keys (``sbx ssh-key add``, ``POST /v1/ssh-keys``); a key opens ``ssh <sandbox>@host -p
2222`` for the sandboxes of its account only. The table ``ssh_keys`` (migration 0016) keeps the key in OpenSSH's
one-line form (no comment), its algorithm and its SHA256 fingerprint (``SHA256:...``, as ``ssh-keygen -l`` prints
it), unique per account. Only public keys are ever stored: a private key, a certificate or anything else
asyncssh cannot read as one public key is 400 ``invalid_ssh_key``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import asyncssh
from sqlalchemy import DateTime, String, Text, UniqueConstraint, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, mapped_column

from sbx.control.errors import ControlError, not_found
from sbx.control.store.database import Base, Store, iso, utcnow
from sbx.control.store.ids import new_id

MAX_KEY_TEXT = 16 * 1024
"""The longest public key text accepted (an RSA 16384-bit key is ~2.8 KB)."""
ALGORITHMS = frozenset({"ssh-ed25519", "ssh-rsa", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384",
                        "ecdsa-sha2-nistp521", "sk-ssh-ed25519@openssh.com",
                        "sk-ecdsa-sha2-nistp256@openssh.com"})
"""Key types an account may register (no DSA, no certificates)."""


class SshKeyRow(Base):
    """A registered key: ``public_key`` (``<algorithm> <base64>``), ``fingerprint`` (``SHA256:...``)."""

    __tablename__ = "ssh_keys"
    __table_args__ = (UniqueConstraint("account_id", "fingerprint", name="uq_ssh_keys_account_fingerprint"),)

    id: Mapped[str] = mapped_column(String(24), primary_key=True)
    account_id: Mapped[str] = mapped_column(String(24), index=True)
    name: Mapped[str] = mapped_column(String(100))
    algorithm: Mapped[str] = mapped_column(String(64))
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    public_key: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


@dataclass(frozen=True)
class ParsedKey:
    """A public key read from text: ``algorithm``, ``fingerprint``, ``public_key`` (no comment), ``comment``."""

    algorithm: str
    fingerprint: str
    public_key: str
    comment: str


def invalid(message: str) -> ControlError:
    """400 ``invalid_ssh_key`` on field ``publicKey``."""
    return ControlError("invalid_ssh_key", message, 400, field="publicKey")


def parse_key(text: str) -> ParsedKey:
    """Read one OpenSSH public key (``ssh-ed25519 AAAA... comment``, as in ``~/.ssh/id_ed25519.pub``; RFC 4716
    form too). Raises 400 ``invalid_ssh_key`` for anything else: empty, too long, a private key, several keys, a
    certificate or a type outside :data:`ALGORITHMS`."""
    text = (text or "").strip()
    if not text:
        raise invalid("the public key is empty")
    if len(text) > MAX_KEY_TEXT:
        raise invalid(f"a public key is at most {MAX_KEY_TEXT} characters")
    if "PRIVATE KEY" in text:
        raise invalid("this is a private key: give its public half (the .pub file), and keep the private key to "
                      "yourself")
    if text.count("\n") and not text.startswith("----"):
        raise invalid("give one public key (one line)")
    try:
        key = asyncssh.import_public_key(text)
    except Exception as e:  # asyncssh's parsers raise several kinds on malformed input: all are a bad key here
        raise invalid(f"not an OpenSSH public key: {e}") from None
    algorithm = key.get_algorithm()
    if algorithm not in ALGORITHMS:
        raise invalid(f"key type {algorithm} is not accepted; use one of: {', '.join(sorted(ALGORITHMS))}")
    comment = key.get_comment() or ""
    key.set_comment(None)
    public = key.export_public_key("openssh").decode().strip()
    return ParsedKey(algorithm, key.get_fingerprint("sha256"), public, comment)


def key_view(row: SshKeyRow) -> dict[str, Any]:
    """API shape: ``{id, account, name, algorithm, fingerprint, publicKey, createdAt}``."""
    return {"id": row.id, "account": row.account_id, "name": row.name, "algorithm": row.algorithm,
            "fingerprint": row.fingerprint, "publicKey": row.public_key, "createdAt": iso(row.created_at)}


class SshKeys:
    """The accounts' SSH public keys in ``store``."""

    def __init__(self, store: Store):
        self.store = store

    def add(self, account_id: str, text: str, name: str | None = None) -> SshKeyRow:
        """Register public key ``text`` for the account, named ``name`` (default: the key's comment, else its
        type). Raises 400 ``invalid_ssh_key`` / ``invalid_name``, 409 ``ssh_key_exists`` (the account has this key
        already); nothing is stored then."""
        parsed = parse_key(text)
        if name is None:  # the key's comment, made printable and short, else its type
            name = "".join(c for c in parsed.comment if ord(c) >= 32 and ord(c) != 127)[:100] or parsed.algorithm
        name = name.strip()
        if not name or len(name) > 100 or any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise ControlError("invalid_name", "SSH key names are 1-100 characters, no control characters", 400,
                               field="name")
        row = SshKeyRow(id=new_id("sshkey_"), account_id=account_id, name=name, algorithm=parsed.algorithm,
                        fingerprint=parsed.fingerprint, public_key=parsed.public_key, created_at=utcnow())
        try:
            with self.store.session() as s, s.begin():
                held = s.scalar(select(SshKeyRow.id).where(SshKeyRow.account_id == account_id,
                                                           SshKeyRow.fingerprint == parsed.fingerprint))
                if held is not None:
                    raise _exists(parsed.fingerprint, held)
                s.add(row)
        except IntegrityError:  # another request added the same key at the same moment
            raise _exists(parsed.fingerprint, "") from None
        return row

    def of_account(self, account_id: str | None) -> list[SshKeyRow]:
        """The keys of ``account_id`` (None: every account's), oldest first."""
        with self.store.session() as s:
            q = select(SshKeyRow).order_by(SshKeyRow.created_at, SshKeyRow.id)
            if account_id is not None:
                q = q.where(SshKeyRow.account_id == account_id)
            return list(s.scalars(q))

    def remove(self, account_id: str | None, key_id: str) -> SshKeyRow:
        """Delete key ``key_id`` of ``account_id`` (None: of any account); the gateway refuses it from the next
        login on (sessions already open stay). Raises 404 ``not_found`` (also for another account's key)."""
        with self.store.session() as s, s.begin():
            row = s.get(SshKeyRow, key_id)
            if row is None or (account_id is not None and row.account_id != account_id):
                raise not_found(f"SSH key {key_id}")
            s.delete(row)
        return row

    def remove_account(self, account_id: str) -> None:
        """Delete every key of the account (its deletion)."""
        with self.store.session() as s, s.begin():
            for row in s.scalars(select(SshKeyRow).where(SshKeyRow.account_id == account_id)):
                s.delete(row)

    def accounts_of(self, fingerprint: str) -> list[str]:
        """The accounts that registered the key with ``fingerprint`` (``SHA256:...``)."""
        with self.store.session() as s:
            return list(s.scalars(select(SshKeyRow.account_id).where(SshKeyRow.fingerprint == fingerprint)
                                  .order_by(SshKeyRow.created_at)))

    def holds(self, account_id: str, fingerprint: str) -> bool:
        """Whether the account registered the key with ``fingerprint`` (``SHA256:...``)."""
        with self.store.session() as s:
            return s.scalar(select(SshKeyRow.id).where(SshKeyRow.account_id == account_id,
                                                       SshKeyRow.fingerprint == fingerprint)) is not None


def _exists(fingerprint: str, key_id: str) -> ControlError:
    held = f" (as {key_id})" if key_id else ""
    return ControlError("ssh_key_exists", f"this account has the key {fingerprint} already{held}", 409)
