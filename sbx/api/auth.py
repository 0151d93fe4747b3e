"""The API token: one bearer token per server, kept in ``<state_dir>/token`` (mode 0600)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from sbx.config import Settings


def token_path(settings: Settings) -> Path:
    """Where the server's API token lives: ``<settings.state_dir>/token``."""
    return settings.state_dir / "token"


def ensure_token(settings: Settings) -> str:
    """Read the server's API token, creating a random one (``sbx_`` + 43 URL-safe characters) on first use."""
    path = token_path(settings)
    if path.is_file():
        token = path.read_text().strip()
        if token:
            return token
    path.parent.mkdir(parents=True, exist_ok=True)
    token = "sbx_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
