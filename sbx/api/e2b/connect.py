"""The Connect protocol's JSON codec, server side, as far as envd's clients use it (written from the protocol's
public description, https://connectrpc.com/docs/protocol).

- **Unary**: ``POST /<package>.<Service>/<Method>`` with ``Content-Type: application/json`` and the request message
  as proto3 JSON; the answer is ``200`` with the response message as JSON, or an error status with
  ``{"code": "<connect code>", "message": "..."}`` (:func:`unary_error`).
- **Server streaming** and **client streaming**: ``Content-Type: application/connect+json``; the request body
  (one message, or a client stream's several: :class:`EnvelopeReader`) and every response message are
  *envelopes*: one flags byte, a 4-byte big-endian length, then that many bytes of JSON. The response always
  has status 200 and ends with an envelope whose flags have :data:`END_STREAM` set, carrying ``{}`` or
  ``{"error": {"code","message"}}`` (:func:`end_frame`).

Compression is never used (the client sends ``Connect-Accept-Encoding: identity``): a request envelope with the
compressed flag (``0x01``) is refused as ``invalid_argument``.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from starlette.responses import JSONResponse

END_STREAM = 0x02
COMPRESSED = 0x01
STREAM_TYPE = "application/connect+json"
UNARY_TYPE = "application/json"
MAX_MESSAGE = 4 << 20
"""Largest request message accepted, in bytes (envd's requests are small: a command, a path)."""

HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
    "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
    "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}
"""The HTTP status of a unary error answer for each Connect error code (the protocol's table)."""


class ConnectError(Exception):
    """An RPC that fails with Connect error ``code`` (a key of :data:`HTTP_STATUS`) and ``message``."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code if code in HTTP_STATUS else "unknown"
        self.message = message


def frame(message: dict[str, Any], flags: int = 0) -> bytes:
    """One envelope: ``flags``, the big-endian length of the compact JSON of ``message``, the JSON."""
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_frame(error: ConnectError | None = None) -> bytes:
    """The end-of-stream envelope: ``{}``, or ``{"error": {"code","message"}}`` when the stream failed."""
    body: dict[str, Any] = {} if error is None else {"error": {"code": error.code, "message": error.message}}
    return frame(body, END_STREAM)


def parse_envelopes(body: bytes) -> list[dict[str, Any]]:
    """The JSON messages of a request body made of envelopes (a server-streaming call carries exactly one).
    Raises :class:`ConnectError` ``invalid_argument`` for a truncated envelope, a compressed one or one that is
    not a JSON object, ``resource_exhausted`` for one over :data:`MAX_MESSAGE` bytes."""
    reader = EnvelopeReader()
    out = reader.feed(body)
    reader.close()
    return out


class EnvelopeReader:
    """The messages of a client stream's body as its pieces arrive (:meth:`feed`); :meth:`close` at its end."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, piece: bytes) -> list[dict[str, Any]]:
        """The messages completed by ``piece``. Raises :class:`ConnectError` as :func:`parse_envelopes`."""
        self.buffer.extend(piece)
        out: list[dict[str, Any]] = []
        while len(self.buffer) >= 5:
            flags, size = struct.unpack(">BI", self.buffer[:5])
            if flags & COMPRESSED:
                raise ConnectError("invalid_argument", "compressed messages are not supported (use identity)")
            if size > MAX_MESSAGE:
                raise ConnectError("resource_exhausted", f"message of {size} bytes is over {MAX_MESSAGE}")
            if len(self.buffer) < 5 + size:
                break
            out.append(parse_json(bytes(self.buffer[5:5 + size])))
            del self.buffer[:5 + size]
        return out

    def close(self) -> None:
        """The body has ended: ``invalid_argument`` when it ended inside an envelope."""
        if 0 < len(self.buffer) < 5:
            raise ConnectError("invalid_argument", "truncated envelope: fewer than 5 header bytes")
        if self.buffer:
            size = struct.unpack(">I", self.buffer[1:5])[0]
            raise ConnectError("invalid_argument", f"truncated envelope: {size} bytes announced, "
                               f"{len(self.buffer) - 5} sent")


def parse_json(data: bytes) -> dict[str, Any]:
    """A request message from its JSON bytes (empty = ``{}``); ``invalid_argument`` unless a JSON object."""
    if not data.strip():
        return {}
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ConnectError("invalid_argument", f"the message is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConnectError("invalid_argument", "the message must be a JSON object")
    return value


def unary_error(error: ConnectError) -> JSONResponse:
    """The unary error answer: the code's HTTP status and ``{"code","message"}``."""
    return JSONResponse({"code": error.code, "message": error.message}, status_code=HTTP_STATUS[error.code])
