"""The ``envdAccessToken`` of a sandbox: what the REST API hands the account that owns it, and what the envd side
(:mod:`sbx.api.e2b.envd`) then asks for in ``X-Access-Token``; and the ``trafficAccessToken`` of a sandbox whose
ports are not public (:mod:`sbx.api.e2b.hosts`), asked for in ``E2B-Traffic-Access-Token``.

A token is ``HMAC-SHA256(secret, sandbox id)`` in hex, so nothing per sandbox is stored; the secret is made once
per installation in ``<state_dir>/e2b-secret`` (mode 0600) and read at start. Replicas of one installation must
share that file.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path


def load_secret(state_dir: Path) -> bytes:
    """The installation's token secret, made (32 random bytes, hex, mode 0600) on first use."""
    path = state_dir / "e2b-secret"
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    state_dir.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it meanwhile: use theirs
        return path.read_bytes().strip()
    with os.fdopen(fd, "wb") as f:
        f.write(value)
    return value


def access_token(secret: bytes, sandbox_id: str) -> str:
    """The access token of sandbox ``sandbox_id`` (64 hex characters)."""
    return hmac.new(secret, sandbox_id.encode(), hashlib.sha256).hexdigest()


def traffic_token(secret: bytes, sandbox_id: str) -> str:
    """The ``trafficAccessToken`` of sandbox ``sandbox_id`` (64 hex characters, never its access token)."""
    return hmac.new(secret, b"traffic:" + sandbox_id.encode(), hashlib.sha256).hexdigest()
