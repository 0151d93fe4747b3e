"""sbx's log output (issue 35): the text lines it always wrote, or one JSON object per line (``--log-format json`` or
``SBX_LOG_FORMAT=json``) with ``time``, ``level``, ``logger``, ``message`` and, when known, ``sandboxId`` and
``requestId`` (plus ``exception`` for a traceback).

The two ids are context variables: the API's middleware sets :data:`request_id` for each request
(:mod:`sbx.api.observe`), and the control plane's worker threads set both for the operation they run (the ids are
handed to the thread explicitly: a thread pool does not carry context variables over). This module imports nothing
of sbx's other rooms, so every room may set them.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("sbx_request_id", default=None)
"""The id of the API request being served (``X-Request-Id``), or None."""
sandbox_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("sbx_sandbox_id", default=None)
"""The sandbox the code running now acts on, or None."""

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The text line sbx writes by default (as before JSON logs existed)."""
FORMATS = ("text", "json")
"""The values ``--log-format`` and ``SBX_LOG_FORMAT`` take."""

T = TypeVar("T")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``message``,
    ``sandboxId`` and ``requestId`` when set (the record's own attributes of those names first, then the context
    variables), ``exception`` when the record carries one."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON (no newline inside: the message's own are escaped)."""
        out: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        sid = getattr(record, "sandboxId", None) or sandbox_id.get()
        rid = getattr(record, "requestId", None) or request_id.get()
        if sid:
            out["sandboxId"] = sid
        if rid:
            out["requestId"] = rid
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: str = "info", fmt: str = "text") -> None:
    """Set up the root logger at ``level`` with the ``fmt`` output (``text``: :data:`TEXT_FORMAT`, as before;
    ``json``: :class:`JsonFormatter`) on standard error. Raises ValueError for another format."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if fmt == "text":
        logging.basicConfig(level=level.upper(), format=TEXT_FORMAT)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def uvicorn_log_config(fmt: str) -> dict[str, Any] | None:
    """What to pass uvicorn as ``log_config``: None for ``json`` (uvicorn then installs no handler of its own and its
    loggers' records reach the root's JSON handler), else uvicorn's default, as before."""
    if fmt == "json":
        return None
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG  # type: ignore[no-any-return]


@contextmanager
def bound(sandbox: str | None = None, request: str | None = None) -> Iterator[None]:
    """Within the block, log lines carry ``sandbox`` and ``request`` (each only when given)."""
    tokens = []
    if sandbox is not None:
        tokens.append((sandbox_id, sandbox_id.set(sandbox)))
    if request is not None:
        tokens.append((request_id, request_id.set(request)))
    try:
        yield
    finally:
        for var, tok in reversed(tokens):
            var.reset(tok)


def carry_to(sandbox: str | None = None) -> Callable[[Callable[[], T]], Callable[[], T]]:
    """A decorator: the function, made for another thread, runs with the request id of the caller (read when it
    is decorated) and ``sandbox`` bound (the caller's sandbox id when None). A worker thread's log lines then name
    the operation's sandbox and the request that began it."""
    rid, sid = request_id.get(), sandbox if sandbox is not None else sandbox_id.get()

    def wrap(fn: Callable[[], T]) -> Callable[[], T]:
        def run() -> T:
            with bound(sid, rid):
                return fn()

        return run

    return wrap
