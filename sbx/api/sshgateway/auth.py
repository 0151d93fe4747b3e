"""Who may log in through the SSH gateway, and the gateway's own keys.

**Users.** The login name names the sandbox: its id (``sb_2qw3qudhmi``) or its name, and ``+root`` after it logs in
as the sandbox's root instead of ``user`` (``sb_2qw3qudhmi+root``). A user's key opens a sandbox only when the key is
registered (:mod:`sbx.control.accounts.sshkeys`) for the sandbox's own account and that account is active. Every
other case (an unknown or deleted sandbox, another account's, a wrong key, a malformed name) is the same ``False``
the SSH client reports as ``Permission denied (publickey)``: nothing tells a sandbox that exists from one that
doesn't. Passwords and keyboard-interactive are never offered.

**The gateway's keys** live under ``<state_dir>/ssh`` (folder 0700, files 0600, made on the first start): its SSH
host key (``host_ed25519``: what users' ``known_hosts`` remember) and a 32-byte secret (``client_seed``) that the
gateway's client keys are derived from, one Ed25519 key per sandbox (HMAC-SHA256 of the sandbox id). A sandbox only
ever sees the public half of its own key (:func:`install_command`): a key one sandbox learns opens no other sandbox.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path

import asyncssh
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sbx.control.accounts.sshkeys import SshKeys
from sbx.control.errors import ControlError
from sbx.control.service import ControlPlane

ROOT_SUFFIX = "+root"
"""After the sandbox in a login name: log in as the sandbox's root (default: ``user``)."""
_TARGET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
KEY_COMMENT = "sbx-gateway"
"""The comment on the gateway's key line in a sandbox's ``authorized_keys``."""


@dataclass(frozen=True)
class Target:
    """Where an authenticated login goes: ``sandbox_id``, its ``account_id``, and ``user`` in the sandbox."""

    sandbox_id: str
    account_id: str
    user: str


def parse_login(username: str) -> tuple[str, str] | None:
    """``(sandbox id or name, user in the sandbox)`` of a login name, or None when it can name no sandbox."""
    user = "user"
    if username.endswith(ROOT_SUFFIX):
        username, user = username[: -len(ROOT_SUFFIX)], "root"
    if not _TARGET_RE.match(username):
        return None
    return username, user


def authorize(cp: ControlPlane, keys: SshKeys, username: str, key: asyncssh.SSHKey) -> Target | None:
    """The :class:`Target` that ``key`` may open as ``username``, or None (the same None for every refusal).
    Blocking (the store): run it in a thread."""
    parsed = parse_login(username)
    if parsed is None:
        return None
    name, user = parsed
    accounts = [a for a in keys.accounts_of(key.get_fingerprint("sha256")) if account_active(cp, a)]
    if not accounts:
        return None
    try:
        row = cp.get(name)  # a sandbox id
    except ControlError:
        row = None
    if row is not None:
        return Target(row.id, row.account_id, user) if row.account_id in accounts else None
    for account_id in accounts:  # a sandbox name, among the key's accounts' sandboxes
        for row in cp.list_sandboxes(account_id=account_id):
            if row.name == name:
                return Target(row.id, account_id, user)
    return None


def account_active(cp: ControlPlane, account_id: str) -> bool:
    """Whether the account may still use its sandboxes (checked again when a session opens)."""
    try:
        return cp.accounts.get_account(account_id).state == "active"
    except ControlError:
        return False


def _private_file(path: Path, make: bytes) -> bytes:
    """The bytes of ``path`` (mode 0600), written with ``make`` first if it does not exist."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(make)
    try:
        os.link(tmp, path)  # never over a file another replica or process made meanwhile
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_bytes()


class GatewayKeys:
    """The gateway's host key and client keys, kept in ``folder`` (see the module docstring)."""

    def __init__(self, folder: Path):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        fresh = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
        self.host_key = asyncssh.import_private_key(_private_file(folder / "host_ed25519", fresh))
        self._seed = _private_file(folder / "client_seed", secrets.token_bytes(32))
        self._cache: dict[str, asyncssh.SSHKey] = {}

    def client_key(self, sandbox_id: str) -> asyncssh.SSHKey:
        """The private key the gateway logs in to ``sandbox_id``'s sshd with (the same after a restart)."""
        key = self._cache.get(sandbox_id)
        if key is None:
            seed = hmac.new(self._seed, b"sbx-ssh-gateway/" + sandbox_id.encode(), hashlib.sha256).digest()
            pem = Ed25519PrivateKey.from_private_bytes(seed).private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
            key = asyncssh.import_private_key(pem)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[sandbox_id] = key
        return key

    def public_line(self, sandbox_id: str) -> str:
        """``ssh-ed25519 AAAA... sbx-gateway``: the line the sandbox's ``authorized_keys`` gets."""
        pub = self.client_key(sandbox_id).export_public_key("openssh").decode().split()
        return f"{pub[0]} {pub[1]} {KEY_COMMENT}"


def install_command(public_line: str) -> str:
    """A shell command, run in the sandbox as the login's user, that adds ``public_line`` (a public key and
    nothing else) to that user's ``~/.ssh/authorized_keys`` unless it is there (other lines, another replica's
    gateway's too, stay)."""
    line = shlex.quote(public_line)
    return ("set -e; umask 077; h=$(getent passwd \"$(id -un)\" | cut -d: -f6); h=${h:-$HOME}; "
            "mkdir -p \"$h/.ssh\"; f=\"$h/.ssh/authorized_keys\"; touch \"$f\"; "
            f"if ! grep -qxF {line} \"$f\"; then printf '%s\\n' {line} >> \"$f\"; fi")
