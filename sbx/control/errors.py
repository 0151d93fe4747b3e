"""Errors the control plane raises, each with a stable ``code`` and the HTTP status the API answers with.

The API layer turns a :class:`ControlError` into ``{"error": {"code": ..., "message": ..., "field"?, "state"?}}``
with ``status``.
"""

from __future__ import annotations


class ControlError(Exception):
    """A request the control plane refuses or could not carry out.

    - ``code``: stable machine-readable code (``not_found``, ``busy``, ``invalid_type``, ...).
    - ``message``: one human sentence.
    - ``status``: the HTTP status for it (400, 404, 409, 502, ...).
    - ``state``: the sandbox's current state when relevant (``busy``, ``not_running``), else None.
    - ``field``: the request field at fault (``cwd``, ``ttl``, ``path``...), else None.
    - ``extra``: more members of the error object (``plan_limit``: ``limit``, ``plan``, ``upgrade``), else None.
    - ``headers``: HTTP headers to answer with (``Retry-After`` on a 429), else None.
    """

    def __init__(self, code: str, message: str, status: int = 400, state: str | None = None,
                 field: str | None = None, extra: dict[str, object] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.state = state
        self.field = field
        self.extra = extra
        self.headers = headers


def not_found(what: str) -> ControlError:
    """404 ``not_found`` for a sandbox, snapshot or job ``what`` that does not exist."""
    return ControlError("not_found", f"{what} not found", 404)


def busy(sandbox_id: str, state: str) -> ControlError:
    """409 ``busy``: an operation is still in flight on the sandbox after the bounded wait."""
    return ControlError("busy", f"sandbox {sandbox_id} is busy ({state}); try again shortly", 409, state)


# Node error codes that mean "not possible now" rather than "the node broke".
NODE_CONFLICT_CODES = {"cpu_mismatch", "no_checkpoint", "memory_unavailable", "not_running", "snapshot_exists",
                       "not_supported"}


def from_node(code: str, message: str) -> ControlError:
    """Map a :class:`sbx.node.types.NodeError` to a control error: ``not_found`` -> 404, codes in
    :data:`NODE_CONFLICT_CODES` -> 409, anything else -> 502 (the node failed)."""
    if code == "not_found":
        return ControlError(code, message, 404)
    if code.startswith("invalid_"):  # the node refused the request's content (invalid_resize, invalid_snapshot_name)
        return ControlError(code, message, 400)
    if code in NODE_CONFLICT_CODES:
        return ControlError(code, message, 409)
    return ControlError(code, message, 502)
