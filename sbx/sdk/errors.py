"""Errors raised by the sbx SDK."""

from __future__ import annotations


class SbxError(Exception):
    """An error answered by the sbx server (or met on the way to it).

    - ``code``: the server's stable error code (``not_found``, ``busy``, ``invalid_resize``, ...), or
      ``unreachable`` when the server could not be reached, ``bad_response`` for an answer that is not sbx JSON,
      ``no_config`` when no server URL/token is configured.
    - ``message``: the server's message.
    - ``status``: the HTTP status (0 when there was no answer).
    """

    def __init__(self, code: str, message: str, status: int = 0):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
