"""The SDK's HTTP calls, written once without I/O ("sans-IO") and shared by the sync and async clients.

Each operation is a generator: it yields :class:`Request` objects, receives a :class:`Response` for each, and
returns the parsed result. :mod:`sbx.sdk.client` drives these generators with an ``httpx.Client`` or an
``httpx.AsyncClient``; nothing here touches the network.

Streaming requests (NDJSON) hand each parsed line to ``Request.on_line`` as it arrives; returning True from it
stops reading. Binary requests (files) send ``Request.content`` as the raw body (bytes or an iterator of bytes;
an async iterator with the async client) and, with ``binary``, hand the answer's bytes to ``Request.on_chunk`` as
they arrive (or return them whole in ``Response.body`` when there is no ``on_chunk``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from sbx.sdk.errors import TYPED_ERRORS, SbxError

LineHandler = Callable[[dict[str, Any]], bool | None]
ChunkHandler = Callable[[bytes], object]
Call = Generator["Request", "Response", Any]

WAIT_TIMEOUT = 900.0
"""Seconds the server may take to finish a long operation when waiting for it."""


@dataclass
class Request:
    """One HTTP call: ``method``, ``path`` (from the server root), JSON ``body``, query ``params``; ``stream`` for
    NDJSON answers (lines go to ``on_line``); ``timeout`` is the read timeout in seconds (None = unlimited);
    ``content`` a raw request body instead of JSON; ``binary`` for a raw answer (chunks go to ``on_chunk``)."""

    method: str
    path: str
    body: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    on_line: LineHandler | None = None
    timeout: float | None = 60.0
    content: Any = None
    binary: bool = False
    on_chunk: ChunkHandler | None = None


@dataclass
class Response:
    """The status and, for non-streaming requests, the decoded JSON body."""

    status: int
    body: Any = None


@dataclass
class ExecResult:
    """The outcome of :meth:`Sandbox.exec`: all ``stdout`` and ``stderr`` text, the command's ``exit_code``
    (124 after a timeout, 137 when it was SIGKILLed, e.g. for memory), and ``timed_out``. With ``binary=True``
    ``stdout_bytes`` / ``stderr_bytes`` hold the exact bytes (and ``stdout``/``stderr`` their UTF-8 reading)."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""


def error_from(status: int, raw: bytes) -> SbxError:
    """Turn an error answer (``{"error": {"code", "message"}}``) into :class:`SbxError` (or its subclass for the
    code, see :data:`sbx.sdk.errors.TYPED_ERRORS`)."""
    try:
        err = json.loads(raw)["error"]
        code = str(err["code"])
        return TYPED_ERRORS.get(code, SbxError)(code, str(err.get("message", "")), status)
    except (ValueError, KeyError, TypeError):
        text = raw.decode("utf-8", "replace").strip()[:200]
        return SbxError("bad_response", f"HTTP {status}: {text}", status)


def parse_line(raw: str) -> dict[str, Any] | None:
    """One NDJSON line as a dict (None for a blank line)."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        raise SbxError("bad_response", f"not a JSON line: {raw[:100]}") from None
    if not isinstance(obj, dict):
        raise SbxError("bad_response", f"not a JSON object: {raw[:100]}")
    return obj


def _clean(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


def wait_params(wait: bool) -> dict[str, Any]:
    return {"wait": "true", "timeout": WAIT_TIMEOUT} if wait else {}


def _sandbox(resp: Response) -> dict[str, Any]:
    try:
        return dict(resp.body["sandbox"])
    except (TypeError, KeyError):
        raise SbxError("bad_response", "answer has no sandbox", resp.status) from None


def long_timeout(wait: bool) -> float | None:
    return WAIT_TIMEOUT + 30 if wait else 90.0


# sandboxes ---------------------------------------------------------------------------------------------------
def create(
    type: str = "small",
    name: str | None = None,
    ttl: int | None = None,
    from_snapshot: str | None = None,
    no_snapshots: bool = False,
    env: dict[str, str] | None = None,
    wait: bool = True,
    auto_resume: bool = False,
    labels: dict[str, str] | None = None,
    cold: bool = False,
    secrets: list[str] | None = None,
    image: str | None = None,
    runtime: str | None = None,
    volumes: list[dict[str, Any]] | None = None,
) -> Call:
    """``POST /v1/sandboxes``; returns the sandbox dict (running when ``wait``). ``auto_resume``: an exec, a file
    call, a shell or a request on one of its hosted ports resumes it when stopped. ``labels``: string metadata.
    ``cold``: boot even when a memory template of the size is ready. ``secrets``: names of secrets bound to it
    (the egress proxy injects them; it never sees the values). ``image``: start from this image of the account
    (:mod:`sbx.sdk.images`) instead of sbx's default one. ``runtime``: the runtime class, ``"container"`` (default)
    or ``"gvisor"`` (gVisor's own kernel between the sandbox and the host). ``volumes``: the account's volumes to
    mount, ``[{"name", "path", "readOnly"}]`` (:func:`sbx.sdk.volumes.mount`)."""
    body = _clean({"type": type, "name": name, "ttl": ttl, "fromSnapshot": from_snapshot, "env": env,
                   "labels": labels, "secrets": secrets or None, "image": image, "runtime": runtime,
                   "volumes": volumes or None})
    if no_snapshots:
        body["noSnapshots"] = True
    if auto_resume:
        body["autoResume"] = True
    if cold:
        body["cold"] = True
    resp = yield Request("POST", "/v1/sandboxes", body, wait_params(wait), timeout=long_timeout(wait))
    return _sandbox(resp)


def get(sandbox_id: str) -> Call:
    """``GET /v1/sandboxes/{id}``; returns the sandbox dict."""
    resp = yield Request("GET", f"/v1/sandboxes/{sandbox_id}")
    return _sandbox(resp)


def list_sandboxes(labels: dict[str, str] | None = None) -> Call:
    """``GET /v1/sandboxes``; returns a list of sandbox dicts (only those carrying every label in ``labels``)."""
    params = {"label": [f"{k}={v}" for k, v in labels.items()]} if labels else {}
    resp = yield Request("GET", "/v1/sandboxes", None, params)
    return list(resp.body["sandboxes"])


def stop(sandbox_id: str, keep_memory: bool = True, wait: bool = True) -> Call:
    """``POST /v1/sandboxes/{id}/stop``; returns the sandbox dict."""
    resp = yield Request("POST", f"/v1/sandboxes/{sandbox_id}/stop", {"keepMemory": keep_memory},
                         wait_params(wait), timeout=long_timeout(wait))
    return _sandbox(resp)


def resume(
    sandbox_id: str, type: str | None = None, require_memory: bool = False, ttl: int | None = None,
    wait: bool = True,
) -> Call:
    """``POST /v1/sandboxes/{id}/resume``; returns the sandbox dict."""
    body = _clean({"type": type, "ttl": ttl})
    if require_memory:
        body["requireMemory"] = True
    resp = yield Request("POST", f"/v1/sandboxes/{sandbox_id}/resume", body, wait_params(wait),
                         timeout=long_timeout(wait))
    return _sandbox(resp)


def fork(
    sandbox_id: str, type: str | None = None, ttl: int | None = None, name: str | None = None,
    env: dict[str, str] | None = None, wait: bool = True, memory: bool = False, secrets: list[str] | None = None,
) -> Call:
    """``POST /v1/sandboxes/{id}/fork``; returns the fork's sandbox dict (``memory``: fork with memory). A fork
    gets only the ``secrets`` named here, not its source's."""
    body = _clean({"type": type, "ttl": ttl, "name": name, "env": env, "secrets": secrets or None})
    if memory:
        body["memory"] = True
    resp = yield Request("POST", f"/v1/sandboxes/{sandbox_id}/fork", body, wait_params(wait),
                         timeout=long_timeout(wait))
    return _sandbox(resp)


def delete(sandbox_id: str, wait: bool = True) -> Call:
    """``DELETE /v1/sandboxes/{id}``; returns the sandbox dict (state ``deleted`` when ``wait``)."""
    resp = yield Request("DELETE", f"/v1/sandboxes/{sandbox_id}", None, wait_params(wait),
                         timeout=long_timeout(wait))
    return _sandbox(resp)


def events(
    sandbox_id: str, after: int = 0, follow: bool = False, until_settled: bool = False,
    on_event: LineHandler | None = None,
) -> Call:
    """``GET /v1/sandboxes/{id}/events``; returns the list of event dicts (each also passed to ``on_event``)."""
    got: list[dict[str, Any]] = []

    def on_line(obj: dict[str, Any]) -> bool | None:
        got.append(obj)
        return on_event(obj) if on_event else None

    params: dict[str, Any] = {"after": after}
    if until_settled:
        params["until"] = "settled"
    elif follow:
        params["follow"] = "true"
    yield Request("GET", f"/v1/sandboxes/{sandbox_id}/events", None, params, stream=True, on_line=on_line,
                  timeout=None if (follow or until_settled) else 60.0)
    return got


# snapshots ---------------------------------------------------------------------------------------------------
def snapshot(sandbox_id: str, name: str) -> Call:
    """``POST /v1/sandboxes/{id}/snapshot``; returns the snapshot dict."""
    resp = yield Request("POST", f"/v1/sandboxes/{sandbox_id}/snapshot", {"name": name})
    return dict(resp.body["snapshot"])


def snapshots(sandbox_id: str | None = None) -> Call:
    """``GET /v1/snapshots``; returns snapshot dicts, optionally only ``sandbox_id``'s."""
    params = {"sandbox": sandbox_id} if sandbox_id else {}
    resp = yield Request("GET", "/v1/snapshots", None, params)
    return list(resp.body["snapshots"])


def migrate(sandbox_id: str, to: str | None = None, wait: bool = True) -> Call:
    """``POST /v1/sandboxes/{id}/migrate`` (admin key): live-migrate a running sandbox to node ``to`` (default:
    placement picks); returns the sandbox dict (``node`` is the destination once it has moved)."""
    resp = yield Request("POST", f"/v1/sandboxes/{sandbox_id}/migrate", _clean({"to": to}), wait_params(wait),
                         timeout=long_timeout(wait))
    return _sandbox(resp)


def delete_snapshot(name: str) -> Call:
    """``DELETE /v1/snapshots/{name}``."""
    yield Request("DELETE", f"/v1/snapshots/{name}")
    return None


# exec and jobs -----------------------------------------------------------------------------------------------
class ExecCollector:
    """Accumulates exec-style NDJSON lines into an :class:`ExecResult`, passing output to optional callbacks as it
    comes (text; bytes when ``binary``, from base64 frames). An ``{"error": ...}`` line raises :class:`SbxError`.
    Reads the exit line as ``exitCode``/``timedOut`` (and the older ``exit_code``/``timed_out``)."""

    def __init__(self, on_stdout: Callable[[Any], object] | None = None,
                 on_stderr: Callable[[Any], object] | None = None, binary: bool = False):
        self.out: list[Any] = []
        self.err: list[Any] = []
        self.exit_code: int | None = None
        self.timed_out = False
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self.binary = binary

    def __call__(self, obj: dict[str, Any]) -> bool | None:
        if "error" in obj:
            err = obj["error"]
            raise SbxError(str(err.get("code", "exec_failed")), str(err.get("message", "")), 200)
        for code_key, timed_key in (("exitCode", "timedOut"), ("exit_code", "timed_out")):
            if code_key in obj:
                self.exit_code = int(obj[code_key])
                self.timed_out = bool(obj.get(timed_key, False))
                return True
        data: Any = obj.get("data", "")
        if obj.get("encoding") == "base64":
            data = base64.b64decode(data)
            if not self.binary:
                data = data.decode("utf-8", "replace")
        elif self.binary:
            data = str(data).encode()
        if obj.get("stream") == "stderr":
            self.err.append(data)
            if self.on_stderr:
                self.on_stderr(data)
        else:
            self.out.append(data)
            if self.on_stdout:
                self.on_stdout(data)
        return None

    def result(self) -> ExecResult:
        if self.exit_code is None:
            raise SbxError("exec_failed", "the output ended without an exit status")
        if self.binary:
            out, err = b"".join(self.out), b"".join(self.err)
            return ExecResult(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), self.exit_code,
                              self.timed_out, out, err)
        return ExecResult("".join(self.out), "".join(self.err), self.exit_code, self.timed_out)


def exec_(
    sandbox_id: str, command: str, timeout: float | None = 30.0, user: str = "user",
    env: dict[str, str] | None = None, cwd: str | None = None,
    on_stdout: Callable[[Any], object] | None = None, on_stderr: Callable[[Any], object] | None = None,
    binary: bool = False,
) -> Call:
    """``POST /v1/sandboxes/{id}/exec``; returns an :class:`ExecResult` (a non-zero exit does not raise). With
    ``binary`` the output travels as base64 frames and arrives exactly (callbacks get ``bytes``)."""
    collector = ExecCollector(on_stdout, on_stderr, binary)
    body = _clean({"command": command, "user": user, "env": env, "cwd": cwd,
                   "encoding": "base64" if binary else None})
    body["timeout"] = timeout
    read_timeout = None if not timeout else timeout + 300.0
    yield Request("POST", f"/v1/sandboxes/{sandbox_id}/exec", body, stream=True, on_line=collector,
                  timeout=read_timeout)
    return collector.result()


def exec_detached(sandbox_id: str, command: str, user: str = "user", env: dict[str, str] | None = None,
                  cwd: str | None = None, timeout: float | None = None, stdin: str | None = None) -> Call:
    """``POST /v1/sandboxes/{id}/jobs``; returns the job dict (``id``, ``command``, ``running``, ``exitCode``,
    ``startedAt``). ``timeout`` seconds kills it (exit 124); ``stdin`` is text fed to it."""
    body = _clean({"command": command, "user": user, "env": env, "cwd": cwd, "timeout": timeout, "stdin": stdin})
    resp = yield Request("POST", f"/v1/sandboxes/{sandbox_id}/jobs", body, timeout=300.0)
    return dict(resp.body["job"])


def kill_job(sandbox_id: str, job_id: str) -> Call:
    """``POST .../jobs/{job}/kill``; returns the job dict once it has ended (``exitCode`` 137)."""
    resp = yield Request("POST", f"/v1/sandboxes/{sandbox_id}/jobs/{job_id}/kill", None, timeout=120.0)
    return dict(resp.body["job"])


def jobs(sandbox_id: str) -> Call:
    """``GET /v1/sandboxes/{id}/jobs``; returns job dicts."""
    resp = yield Request("GET", f"/v1/sandboxes/{sandbox_id}/jobs")
    return list(resp.body["jobs"])


def job_logs(
    sandbox_id: str, job_id: str, follow: bool = False,
    on_stdout: Callable[[Any], object] | None = None, on_stderr: Callable[[Any], object] | None = None,
) -> Call:
    """``GET .../jobs/{job}/logs``; returns an :class:`ExecResult` when the job has ended, else a partial one with
    ``exit_code`` -1."""
    collector = ExecCollector(on_stdout, on_stderr)
    params = {"follow": "true"} if follow else {}
    yield Request("GET", f"/v1/sandboxes/{sandbox_id}/jobs/{job_id}/logs", None, params, stream=True,
                  on_line=collector, timeout=None if follow else 60.0)
    if collector.exit_code is None:
        return ExecResult("".join(collector.out), "".join(collector.err), -1)
    return collector.result()


def job_wait(sandbox_id: str, job_id: str, timeout: float = 300.0) -> Call:
    """``GET .../jobs/{job}/wait``; returns the job dict (``running`` may still be true after ``timeout``)."""
    resp = yield Request("GET", f"/v1/sandboxes/{sandbox_id}/jobs/{job_id}/wait", None, {"timeout": timeout},
                         timeout=timeout + 60.0)
    return dict(resp.body["job"])


# hosted ports ------------------------------------------------------------------------------------------------
def host(sandbox_id: str, port: int, public: bool = False) -> Call:
    """``POST /v1/sandboxes/{id}/routes``; returns the route dict (``port``, ``public``, ``url``, ``host``,
    ``token``, ``createdAt``)."""
    resp = yield Request("POST", f"/v1/sandboxes/{sandbox_id}/routes", {"port": port, "public": public})
    return dict(resp.body["route"])


def routes(sandbox_id: str) -> Call:
    """``GET /v1/sandboxes/{id}/routes``; returns route dicts by port."""
    resp = yield Request("GET", f"/v1/sandboxes/{sandbox_id}/routes")
    return list(resp.body["routes"])


def unhost(sandbox_id: str, port: int) -> Call:
    """``DELETE /v1/sandboxes/{id}/routes/{port}``."""
    yield Request("DELETE", f"/v1/sandboxes/{sandbox_id}/routes/{int(port)}")
    return None
