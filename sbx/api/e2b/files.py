"""envd's plain-HTTP ``/files`` calls of the E2B compatibility layer (:mod:`sbx.api.e2b.envd` serves them):
download a file, upload one (``application/octet-stream``, gzip allowed) or several (``multipart/form-data``),
with file metadata from ``X-Metadata-*`` headers (:func:`sbx.api.e2b.fs.set_metadata`),
through the control plane's file calls (:mod:`sbx.control.sandboxes.files`) as ``user`` or ``root``. Errors are
envd's ``{"code": status, "message"}``."""

from __future__ import annotations

import re
import zlib
from typing import TYPE_CHECKING

from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import sbx.api.e2b.fs as fs
from sbx.api.e2b.connect import ConnectError
from sbx.control.errors import ControlError

if TYPE_CHECKING:
    from sbx.control.service import ControlPlane

USERS = ("user", "root")
"""The users an E2B call may name (``username``/``user``, or Basic auth): the sbx image's two."""
METADATA_HEADER = "x-metadata-"
"""Headers of file metadata (lowercase, as the server sees them)."""
METADATA_KEY = re.compile(r"\A[a-z0-9!#$%&'*+\-.^_`|~]{1,200}\Z")
METADATA_VALUE = re.compile(r"\A[\x20-\x7e]*\Z")
METADATA_MAX = 64
METADATA_BYTES = 3000
"""Most metadata keys, and key and value bytes, an upload may set (what fits in one ext4 attribute block)."""
UPLOAD_MAX = 256 << 20
"""Largest multipart upload accepted, in bytes (it is parsed in memory; octet-stream uploads stream and have no
limit)."""


def http_error(status: int, message: str) -> JSONResponse:
    """envd's plain-HTTP error body ``{"code": status, "message"}``."""
    return JSONResponse({"code": status, "message": message}, status_code=status)


class FilesRoutes:
    """``GET /files`` and ``POST /files`` for :class:`sbx.api.e2b.envd.Envd`, which mixes this in; ``cp`` is its
    control plane."""

    cp: ControlPlane

    @staticmethod
    def _files_user(request: Request) -> str:
        user = request.query_params.get("username") or request.query_params.get("user") or "user"
        if user not in USERS:
            raise FilesError(401, f"unknown user {user[:40]!r}: sbx sandboxes have user and root")
        return user

    async def download(self, request: Request, sid: str) -> Response:
        """``GET /files``: the file's bytes (``application/octet-stream``)."""
        try:
            user = self._files_user(request)
            path = request.query_params.get("path")
            if not path:
                raise FilesError(400, "path is required")
            p = fs.absolute(path, user)
            chunks = await run_in_threadpool(self.cp.files.open_read, sid, p, user)
        except FilesError as e:
            return http_error(e.status, e.message)
        except ConnectError as e:
            return http_error(400, e.message)
        except ControlError as e:
            return _files_error(e, path or "")
        return StreamingResponse(iterate_in_threadpool(chunks), media_type="application/octet-stream")

    async def upload(self, request: Request, sid: str) -> Response:
        """``POST /files``: write one file (octet-stream) or each part of a multipart body."""
        try:
            user = self._files_user(request)
            path = request.query_params.get("path")
            ctype = request.headers.get("content-type", "")
            metadata = upload_metadata(request)
            if ctype.lower().startswith("application/octet-stream"):
                if not path:
                    raise FilesError(400, "path is required for an application/octet-stream upload")
                p = fs.absolute(path, user)
                await self._write_stream(request, sid, p, user)
                return await self._written(sid, [p], metadata, user)
            if not ctype.lower().startswith("multipart/form-data"):
                raise FilesError(400, "the body must be multipart/form-data or application/octet-stream")
            body = bytearray()
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > UPLOAD_MAX:
                    raise FilesError(413, f"a multipart upload is limited to {UPLOAD_MAX} bytes; use "
                                     "application/octet-stream for bigger files")
            parts = parse_multipart(bytes(body), ctype)
            if not parts:
                raise FilesError(400, "no file part in the multipart body")
            if path and len(parts) > 1:
                raise FilesError(400, "several parts need no path (each part's filename is its path)")
            written = []
            for filename, data in parts:
                target = path or filename
                if not target:
                    raise FilesError(400, "a part without filename needs the path parameter")
                p = fs.absolute(target, user)
                await run_in_threadpool(self._write_all, sid, p, user, data)
                written.append(p)
            return await self._written(sid, written, metadata, user)
        except FilesError as e:
            return http_error(e.status, e.message)
        except ConnectError as e:
            return http_error(400, e.message)
        except ControlError as e:
            return _files_error(e, path or "")

    async def _written(self, sid: str, paths: list[str], metadata: dict[str, str], user: str) -> JSONResponse:
        """The upload's answer for the files written at ``paths``, after giving them ``metadata`` (if any)."""
        if metadata:
            try:
                await run_in_threadpool(fs.set_metadata, self.cp, sid, paths, metadata, user)
            except ConnectError as e:
                if e.code == "unavailable":
                    raise
                raise FilesError(400, f"the file was written, but its metadata was refused: {e.message}") from None
        return JSONResponse([{"path": p, "name": p.rsplit("/", 1)[-1], "type": "file",
                              **({"metadata": metadata} if metadata else {})} for p in paths])

    def _write_all(self, sid: str, path: str, user: str, data: bytes) -> None:
        writer = self.cp.files.open_write(sid, path, user)
        try:
            writer.write(data)
        except BaseException:
            writer.abort()
            raise
        writer.finish()

    async def _write_stream(self, request: Request, sid: str, path: str, user: str) -> None:
        gz = request.headers.get("content-encoding", "").lower() == "gzip"
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gz else None
        writer = await run_in_threadpool(self.cp.files.open_write, sid, path, user)
        try:
            async for chunk in request.stream():
                if inflate is not None:
                    try:
                        chunk = inflate.decompress(chunk)
                    except zlib.error as e:
                        raise FilesError(400, f"the body is not valid gzip: {e}") from None
                if chunk:
                    await run_in_threadpool(writer.write, chunk)
        except BaseException:
            await run_in_threadpool(writer.abort)
            raise
        await run_in_threadpool(writer.finish)


class FilesError(Exception):
    """A ``/files`` request answered with envd's ``{"code": status, "message"}``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def upload_metadata(request: Request) -> dict[str, str]:
    """The file metadata of an upload: its ``X-Metadata-<key>`` headers, keys lowercased (envd's rule); 400 for a
    key or value the SDK would not send (keys of HTTP token characters, printable ASCII values) or too much."""
    found = {k[len(METADATA_HEADER):]: v for k, v in request.headers.items() if k.startswith(METADATA_HEADER)}
    for key, value in found.items():
        if not METADATA_KEY.match(key) or not METADATA_VALUE.match(value):
            raise FilesError(400, f"invalid file metadata {key[:60]!r}: keys are HTTP token characters, values "
                             "printable ASCII")
    if len(found) > METADATA_MAX or sum(len(k) + len(v) for k, v in found.items()) > METADATA_BYTES:
        raise FilesError(400, f"too much file metadata: at most {METADATA_MAX} keys and {METADATA_BYTES} bytes")
    return found


def _files_error(e: ControlError, path: str) -> JSONResponse:
    if e.status == 404:
        return http_error(404, f"path '{path}' does not exist")
    if e.status == 409 or e.status >= 500:
        return http_error(502, e.message)
    return http_error(e.status if e.status in (400, 401, 403, 413, 507) else 400, e.message)


def parse_multipart(body: bytes, content_type: str) -> list[tuple[str, bytes]]:
    """``(filename, content)`` of each part of a ``multipart/form-data`` body (RFC 7578) whose boundary is in
    ``content_type``. Raises :class:`FilesError` 400 for a missing boundary or a malformed body."""
    boundary = ""
    for param in content_type.split(";")[1:]:
        key, _, value = param.strip().partition("=")
        if key.lower() == "boundary":
            boundary = value.strip().strip('"')
    if not boundary:
        raise FilesError(400, "multipart/form-data without a boundary")
    delimiter = b"--" + boundary.encode()
    pieces = body.split(delimiter)
    if len(pieces) < 3:
        raise FilesError(400, "malformed multipart body")
    parts = []
    for piece in pieces[1:]:
        if piece.startswith(b"--"):
            break
        head, sep, content = piece.partition(b"\r\n\r\n")
        if not sep:
            raise FilesError(400, "malformed multipart part (no header end)")
        if content.endswith(b"\r\n"):
            content = content[:-2]
        filename = ""
        for line in head.decode("utf-8", "replace").split("\r\n"):
            name, _, value = line.partition(":")
            if name.strip().lower() != "content-disposition":
                continue
            for param in value.split(";")[1:]:
                key, _, val = param.strip().partition("=")
                if key.lower() == "filename":
                    filename = val.strip().strip('"')
        parts.append((filename, content))
    return parts
