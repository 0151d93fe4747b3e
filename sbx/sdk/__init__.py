"""sbx.sdk: Python client for an sbx server.

>>> from sbx.sdk import Sandbox
>>> sb = Sandbox.create(type="small", name="demo", ttl=600)
>>> sb.exec("echo hi").stdout
'hi\\n'
>>> sb.stop(); sb.resume(type="default"); sb.delete()

``AsyncSandbox`` / ``AsyncClient`` are the asyncio twins. The server comes from ``SBX_URL`` / ``SBX_TOKEN`` or
``~/.config/sbx/config.toml``. Failures raise :class:`SbxError` with the server's ``code``, ``message``, ``status``
(:class:`InsufficientCapacity` for ``507 insufficient_capacity``).

The client classes (and httpx under them) load on first use, so a program that needs only
:mod:`sbx.sdk.protocol` or :mod:`sbx.sdk.config` (the ``sbx exec`` fast path) starts without them. The package's
modules import each other by their full names (``import sbx.sdk.protocol as P``), never from the package itself,
whose ``__init__`` loads the client: no module of it imports itself back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sbx.sdk.config import ClientConfig, config_path, load_config
from sbx.sdk.errors import InsufficientCapacity, SbxError
from sbx.sdk.protocol import ExecResult

if TYPE_CHECKING:
    from sbx.sdk.client import AsyncClient, AsyncSandbox, Client, Sandbox

_LAZY = {"AsyncClient", "AsyncSandbox", "Client", "Sandbox"}

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "Client",
    "ClientConfig",
    "ExecResult",
    "InsufficientCapacity",
    "Sandbox",
    "SbxError",
    "config_path",
    "load_config",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from sbx.sdk import client

        return getattr(client, name)
    raise AttributeError(f"module 'sbx.sdk' has no attribute {name!r}")
