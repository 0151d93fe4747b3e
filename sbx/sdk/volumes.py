"""SDK calls for persistent volumes (``sbx volume ...``), sans-IO like :mod:`sbx.sdk.protocol`: drive them with
``Client.run`` / ``AsyncClient.run``.

>>> from sbx.sdk import Client, protocol, volumes
>>> with Client() as c:
...     c.run(volumes.create_volume("data", size_gib=10))
...     sb = c.run(protocol.create(volumes=[volumes.mount("data", "/data")]))
"""

from __future__ import annotations

from typing import Any

from sbx.sdk.errors import SbxError
from sbx.sdk.protocol import Call, Request


def mount(name: str, path: str, read_only: bool = False) -> dict[str, Any]:
    """One item of ``protocol.create(volumes=[...])``: volume ``name`` at ``path`` in the sandbox."""
    return {"name": name, "path": path, "readOnly": read_only}


def parse_mount(text: str) -> dict[str, Any]:
    """``NAME:/path[:ro|:rw]`` (the CLI's ``--volume``) as a :func:`mount` item. Raises
    ``SbxError("invalid_volume")`` for another shape."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1] or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise SbxError("invalid_volume", f"a volume is NAME:/path or NAME:/path:ro, got {text[:200]!r}", 400)
    return mount(parts[0], parts[1], len(parts) == 3 and parts[2] == "ro")


def create_volume(name: str, size_gib: int | None = None) -> Call:
    """``POST /v1/volumes``; returns the volume dict (``id``, ``name``, ``sizeGiB``, ``createdAt``,
    ``sandboxes``). Raises :class:`SbxError` (``volume_exists``, ``invalid_volume_name``, ``invalid_volume_size``)."""
    body: dict[str, Any] = {"name": name}
    if size_gib is not None:
        body["size"] = size_gib
    resp = yield Request("POST", "/v1/volumes", body)
    return dict(resp.body["volume"])


def volumes() -> Call:
    """``GET /v1/volumes``; returns the account's volume dicts by name."""
    resp = yield Request("GET", "/v1/volumes")
    return list(resp.body["volumes"])


def volume(name: str) -> Call:
    """``GET /v1/volumes/{name}``; returns the volume dict. Raises ``SbxError("volume_not_found")``."""
    resp = yield Request("GET", f"/v1/volumes/{name}")
    return dict(resp.body["volume"])


def delete_volume(name: str) -> Call:
    """``DELETE /v1/volumes/{name}`` (its data goes too). Raises ``SbxError("volume_in_use")`` while a sandbox
    mounts it, ``SbxError("volume_not_found")``."""
    resp = yield Request("DELETE", f"/v1/volumes/{name}")
    return resp.body.get("deleted")
