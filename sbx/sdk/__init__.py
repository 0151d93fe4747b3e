"""sbx.sdk: Python client for an sbx server.

>>> from sbx.sdk import Sandbox
>>> sb = Sandbox.create(type="small", name="demo", ttl=600)
>>> sb.exec("echo hi").stdout
'hi\\n'
>>> sb.stop(); sb.resume(type="default"); sb.delete()

``AsyncSandbox`` / ``AsyncClient`` are the asyncio twins. The server comes from ``SBX_URL`` / ``SBX_TOKEN`` or
``~/.config/sbx/config.toml``. Failures raise :class:`SbxError` with the server's ``code``, ``message``, ``status``
(:class:`InsufficientCapacity` for ``507 insufficient_capacity``).
"""

from sbx.sdk.client import AsyncClient, AsyncSandbox, Client, Sandbox
from sbx.sdk.config import ClientConfig, config_path, load_config
from sbx.sdk.errors import InsufficientCapacity, SbxError
from sbx.sdk.protocol import ExecResult

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
