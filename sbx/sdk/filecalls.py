"""SDK calls for a sandbox's files (read, write, list, stat, remove; a directory as a tar stream), sans-IO like
:mod:`sbx.sdk.protocol`; :mod:`sbx.sdk.files` (``sandbox.files``) and ``sbx files`` drive them."""

from __future__ import annotations

from typing import Any

from sbx.sdk.protocol import Call, ChunkHandler, Request

FILE_TIMEOUT = 600.0
"""Seconds to wait for the next bytes of a file transfer."""


def _file_params(path: str, user: str, archive: bool = False) -> dict[str, Any]:
    params: dict[str, Any] = {"path": path, "user": user}
    if archive:
        params["archive"] = "tar"
    return params


def read_file(sandbox_id: str, path: str, user: str = "user", on_chunk: ChunkHandler | None = None,
              archive: bool = False) -> Call:
    """``GET /v1/sandboxes/{id}/files``: a file's bytes (a directory's tar stream with ``archive``). Returns the
    bytes, or, with ``on_chunk``, passes them on as they come and returns the byte count."""
    got = 0

    def count(chunk: bytes) -> None:
        nonlocal got
        got += len(chunk)
        assert on_chunk is not None
        on_chunk(chunk)

    resp = yield Request("GET", f"/v1/sandboxes/{sandbox_id}/files", None, _file_params(path, user, archive),
                         binary=True, on_chunk=count if on_chunk else None, timeout=FILE_TIMEOUT)
    return got if on_chunk else bytes(resp.body or b"")


def write_file(sandbox_id: str, path: str, data: Any, user: str = "user", archive: bool = False) -> Call:
    """``PUT /v1/sandboxes/{id}/files``: write ``data`` (bytes, str as UTF-8, or an iterator of bytes) to file
    ``path`` (or extract it as a tar stream into directory ``path`` with ``archive``). Returns ``{"path","size"}``."""
    if isinstance(data, str):
        data = data.encode()
    resp = yield Request("PUT", f"/v1/sandboxes/{sandbox_id}/files", None, _file_params(path, user, archive),
                         content=data, timeout=FILE_TIMEOUT)
    return dict(resp.body)


def list_files(sandbox_id: str, path: str, user: str = "user") -> Call:
    """``GET /v1/sandboxes/{id}/files/list``; returns entry dicts (``name``, ``path``, ``type``, ``size``,
    ``mode``, ``mtime``) sorted by name."""
    resp = yield Request("GET", f"/v1/sandboxes/{sandbox_id}/files/list", None, _file_params(path, user))
    return list(resp.body["entries"])


def stat_file(sandbox_id: str, path: str, user: str = "user") -> Call:
    """``GET /v1/sandboxes/{id}/files/stat``; returns one entry dict."""
    resp = yield Request("GET", f"/v1/sandboxes/{sandbox_id}/files/stat", None, _file_params(path, user))
    return dict(resp.body["entry"])


def remove_file(sandbox_id: str, path: str, user: str = "user") -> Call:
    """``DELETE /v1/sandboxes/{id}/files``: remove a file or a directory tree."""
    yield Request("DELETE", f"/v1/sandboxes/{sandbox_id}/files", None, _file_params(path, user))
    return None
