"""One error shape for every status the API answers: ``{"error": {"code", "message", "field"?, "state"?}}``.

- :class:`ControlError` (and a node error mapped by :func:`sbx.control.errors.from_node`) keeps its own code and
  status; ``field`` names the request field at fault, ``state`` the sandbox's state when it explains a 409.
- Request validation: a body that is not JSON (truncated, nested too deeply, not UTF-8), a missing field, a wrong
  type (``"timeout": false``) or an unknown field is 422 ``invalid_request``; a value of the right type outside its
  limits (range, length, pattern, choice, NUL character) is 400 ``invalid_<field>`` (``invalid_timeout``,
  ``invalid_env``, ``invalid_type``...). Either way ``field`` names the first field at fault (dotted, camelCase as
  sent: ``env.FOO``).
- Starlette's own errors: 404 ``not_found``, 405 ``method_not_allowed`` (with ``Allow``), 413 ``body_too_large``.
- Anything unexpected: 500 ``internal`` (logged with its traceback).

:class:`BodyLimit` caps request bodies at ``Settings.max_body_bytes`` (``SBX_MAX_BODY_BYTES``, 1 MiB by default),
except file uploads (``PUT .../files``), which stream into the sandbox and have no cap.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from sbx.control.errors import ControlError, from_node
from sbx.node.types import NodeError

log = logging.getLogger("sbx.api")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# pydantic error types that mean "not the right shape" (422) rather than "a value out of its limits" (400)
_SHAPE_ERRORS = {"missing", "extra_forbidden", "json_invalid", "json_type", "model_type", "model_attributes_type",
                 "int_parsing", "float_parsing", "bool_parsing", "int_from_float", "is_instance_of"}
_FILE_UPLOAD = re.compile(r"^/v1/sandboxes/[^/]+/files$")
#: Image uploads (a build context or an archive, :mod:`sbx.api.images_api`) have a cap of their own.
_IMAGE_UPLOAD = re.compile(r"^/v1/images/(build|import)$")


def error_response(status: int, code: str, message: str, *, field: str | None = None, state: str | None = None,
                   headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None) -> JSONResponse:
    """The JSON error answer ``{"error": {"code","message"[,"field"][,"state"][, extra...]}}`` with ``status``."""
    body: dict[str, Any] = {**(extra or {}), "code": code, "message": message}
    if field is not None:
        body["field"] = field
    if state is not None:
        body["state"] = state
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _is_shape_error(kind: str) -> bool:
    return kind in _SHAPE_ERRORS or kind.endswith("_type")


def validation_error(errors: list[Any]) -> tuple[int, str, str, str | None]:
    """Classify pydantic ``errors`` (as FastAPI reports them): ``(status, code, message, field)``."""
    parts: list[str] = []
    status, code, field = 400, "", None
    for err in errors:
        kind = str(err.get("type", ""))
        loc = [str(p) for p in err.get("loc", ())]
        where_parts = loc[1:] if loc and loc[0] in ("body", "query", "path", "header", "cookie") else loc
        ctx = err.get("ctx") or {}
        if kind == "json_invalid":
            at = f" at byte {where_parts[-1]}" if where_parts else ""
            parts.append(f"the body is not valid JSON{at}: {ctx.get('error', err.get('msg'))}")
            status, code, field = 422, "invalid_request", None
            continue
        if kind == "nul_character":
            where_parts = str(ctx.get("field", "")).split(".") if ctx.get("field") else where_parts
        if loc == ["body"] and kind in ("model_attributes_type", "dict_type", "model_type"):
            parts.append("the body must be a JSON object, sent with Content-Type: application/json")
            status, code = 422, "invalid_request"
            continue
        where = ".".join(where_parts)
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        if field is None and where:
            field = where
        if _is_shape_error(kind) or (kind in ("literal_error", "enum") and not isinstance(err.get("input"), str)):
            status, code = 422, "invalid_request"
        elif status == 400 and not code:
            code = kind if kind.startswith("invalid_") else (
                f"invalid_{_snake(where_parts[0])}" if where_parts else "invalid_request")
    return status, code or "invalid_request", "; ".join(parts) or "malformed request", field


def _parse_failure(exc: BaseException | None) -> str:
    if isinstance(exc, RecursionError):
        return "the body is not valid JSON: nested too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return "the body is not valid JSON: it is not UTF-8"
    return f"the body is not valid JSON: {exc}" if exc is not None else "the body is not valid JSON"


def allowed_methods(app: FastAPI, req: Request) -> list[str]:
    """The methods of every route of ``app`` whose path matches ``req``'s (``HEAD`` with ``GET``), sorted."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**req.scope, "method": "\0"})
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def install(app: FastAPI) -> None:
    """Register the exception handlers that give every error the shape above."""

    @app.exception_handler(ControlError)
    async def _control_error(_req: Request, exc: ControlError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if exc.headers:
            headers = {**(headers or {}), **exc.headers}
        return error_response(exc.status, exc.code, exc.message, field=exc.field, state=exc.state, headers=headers,
                              extra=exc.extra)

    @app.exception_handler(NodeError)
    async def _node_error(_req: Request, exc: NodeError) -> JSONResponse:
        mapped = from_node(exc.code, exc.message)
        return error_response(mapped.status, mapped.code, mapped.message)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        status, code, message, field = validation_error(list(exc.errors()))
        return error_response(status, code, message, field=field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers) if exc.headers else None
        if exc.status_code == 405:  # Starlette names only the first route's methods: name every route's at this path
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(app, req))}
        if exc.status_code == 400 and str(exc.detail).startswith("There was an error parsing the body"):
            return error_response(422, "invalid_request", _parse_failure(exc.__cause__))
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status_code,
                                                                                         "http_error")
        return error_response(exc.status_code, code, str(exc.detail), headers=headers)

    @app.exception_handler(Exception)
    async def _internal(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, "internal", f"internal error ({type(exc).__name__}); see the server log")


class BodyLimit:
    """ASGI middleware: answer 413 ``body_too_large`` to a request whose body is over ``limit`` bytes (by its
    ``Content-Length`` before anything runs, or while it streams in), except file uploads."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int):
        self.app = app
        self.limit = limit

    def _message(self) -> str:
        return f"the request body is over {self.limit} bytes (server setting SBX_MAX_BODY_BYTES)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"] == "PUT" and _FILE_UPLOAD.match(scope["path"])) or (
                scope["method"] == "POST" and _IMAGE_UPLOAD.match(scope["path"])):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    body = json.dumps({"error": {"code": "body_too_large", "message": self._message()}}).encode()
                    await send({"type": "http.response.start", "status": 413, "headers": [
                        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        (b"connection", b"close")]})
                    await send({"type": "http.response.body", "body": body})
                    return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise StarletteHTTPException(413, self._message())
            return msg

        await self.app(scope, limited, send)
