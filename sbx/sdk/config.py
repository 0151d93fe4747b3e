"""Where the SDK finds its server: ``SBX_URL`` / ``SBX_TOKEN`` environment variables, else
``~/.config/sbx/config.toml`` (keys ``url`` and ``token``; written by ``sbx server`` on first start)."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from sbx.sdk.errors import SbxError

DEFAULT_URL = "http://127.0.0.1:7070"


def config_path() -> Path:
    """``$XDG_CONFIG_HOME/sbx/config.toml``, default ``~/.config/sbx/config.toml``."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "sbx" / "config.toml"


@dataclass(frozen=True)
class ClientConfig:
    """A server ``url`` (``http://host:port``) and its bearer ``token``."""

    url: str
    token: str


def load_config(url: str | None = None, token: str | None = None) -> ClientConfig:
    """Resolve the server: explicit arguments, then ``SBX_URL``/``SBX_TOKEN``, then the config file.

    Raises ``SbxError("no_config")`` when no token can be found."""
    data: dict[str, object] = {}
    path = config_path()
    if path.is_file():
        try:
            with path.open("rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise SbxError("no_config", f"cannot read {path}: {e}") from None
    final_url = url or os.environ.get("SBX_URL") or str(data.get("url") or DEFAULT_URL)
    final_token = token or os.environ.get("SBX_TOKEN") or str(data.get("token") or "")
    if not final_token:
        raise SbxError(
            "no_config", f"no API token: set SBX_TOKEN or run `sbx server` once to write {path}"
        )
    return ClientConfig(url=final_url.rstrip("/"), token=final_token)
