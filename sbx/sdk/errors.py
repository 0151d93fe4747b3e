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


class InsufficientCapacity(SbxError):
    """``507 insufficient_capacity``: the server's node cannot hold one more sandbox's memory or disk right now
    (``new``, ``resume``, ``fork``); its ``message`` says which, with the figures. Nothing was changed: stop or
    delete a sandbox and try again."""


TYPED_ERRORS: dict[str, type[SbxError]] = {"insufficient_capacity": InsufficientCapacity}
"""Error codes the SDK raises as their own :class:`SbxError` subclass."""
