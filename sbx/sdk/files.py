"""``sandbox.files``: the files API of one sandbox for :class:`sbx.sdk.Sandbox` (``Files``) and
:class:`sbx.sdk.AsyncSandbox` (``AsyncFiles``). Entries (``list``, ``stat``) are dicts ``{"name", "path", "type",
"size", "mode", "mtime"}``: ``mode`` is the permission bits as an int (``oct(entry["mode"])`` gives ``'0o644'``),
``mtime`` Unix seconds."""

from __future__ import annotations

import builtins
from typing import Any

import sbx.sdk.filecalls as FC
import sbx.sdk.protocol as P
from sbx.sdk.errors import SbxError


class Files:
    """``sandbox.files``: files of a running sandbox, read and written inside it as ``user`` (or ``root``). Paths are
    absolute or relative to the user's home (``~`` allowed). Errors: ``not_found``, ``permission_denied``,
    ``is_a_directory``, ``not_a_directory``, ``invalid_path``, ``not_running`` as :class:`SbxError`."""

    def __init__(self, sandbox: Any):
        self._sb: Any = sandbox

    def read(self, path: str, user: str = "user") -> bytes:
        """The file's bytes."""
        return self._sb.client.run(FC.read_file(self._sb.id, path, user))  # type: ignore[no-any-return]

    def read_to(self, path: str, on_chunk: P.ChunkHandler, user: str = "user", archive: bool = False) -> int:
        """Stream the file (or, with ``archive``, a directory as tar) to ``on_chunk``; returns the byte count."""
        return self._sb.client.run(FC.read_file(self._sb.id, path, user, on_chunk, archive))  # type: ignore

    def write(self, path: str, data: Any, user: str = "user", archive: bool = False) -> dict[str, Any]:
        """Write ``data`` (bytes, str, or an iterator of bytes for large files) to ``path``; parents are made.
        With ``archive``, ``data`` is a tar stream extracted into directory ``path``."""
        return self._sb.client.run(FC.write_file(self._sb.id, path, data, user, archive))  # type: ignore

    def list(self, path: str = "~", user: str = "user") -> builtins.list[dict[str, Any]]:
        """Entries of a directory."""
        return self._sb.client.run(FC.list_files(self._sb.id, path, user))  # type: ignore[no-any-return]

    def stat(self, path: str, user: str = "user") -> dict[str, Any]:
        """One entry (``type``, ``size``, ``mode``, ``mtime``)."""
        return self._sb.client.run(FC.stat_file(self._sb.id, path, user))  # type: ignore[no-any-return]

    def exists(self, path: str, user: str = "user") -> bool:
        """True when ``path`` exists."""
        try:
            self.stat(path, user)
            return True
        except SbxError as e:
            if e.code == "not_found":
                return False
            raise

    def remove(self, path: str, user: str = "user") -> None:
        """Remove a file or a directory tree."""
        self._sb.client.run(FC.remove_file(self._sb.id, path, user))


class AsyncFiles:
    """The asyncio twin of :class:`Files`."""

    def __init__(self, sandbox: Any):
        self._sb: Any = sandbox

    async def read(self, path: str, user: str = "user") -> bytes:
        return await self._sb.client.run(FC.read_file(self._sb.id, path, user))  # type: ignore[no-any-return]

    async def read_to(self, path: str, on_chunk: P.ChunkHandler, user: str = "user", archive: bool = False) -> int:
        return await self._sb.client.run(FC.read_file(self._sb.id, path, user, on_chunk, archive))  # type: ignore

    async def write(self, path: str, data: Any, user: str = "user", archive: bool = False) -> dict[str, Any]:
        return await self._sb.client.run(FC.write_file(self._sb.id, path, data, user, archive))  # type: ignore

    async def list(self, path: str = "~", user: str = "user") -> builtins.list[dict[str, Any]]:
        return await self._sb.client.run(FC.list_files(self._sb.id, path, user))  # type: ignore[no-any-return]

    async def stat(self, path: str, user: str = "user") -> dict[str, Any]:
        return await self._sb.client.run(FC.stat_file(self._sb.id, path, user))  # type: ignore[no-any-return]

    async def exists(self, path: str, user: str = "user") -> bool:
        try:
            await self.stat(path, user)
            return True
        except SbxError as e:
            if e.code == "not_found":
                return False
            raise

    async def remove(self, path: str, user: str = "user") -> None:
        await self._sb.client.run(FC.remove_file(self._sb.id, path, user))
