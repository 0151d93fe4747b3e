"""The code-interpreter server of the ``code-interpreter`` image: what E2B's ``e2b-code-interpreter`` SDK calls on
port 49999 of a sandbox (``Sandbox.run_code``, ``create_code_context`` and the other context calls), answered with
Jupyter kernels.

It runs inside the sandbox as ``user`` (``code-interpreter.service``), with Debian's ``python3-jupyter-client`` and
``python3-ipykernel`` and nothing else outside the standard library. The contract, as the SDK reads it:

- ``GET /health``: 200 ``OK``.
- ``POST /execute`` ``{"code", "context_id", "language", "env_vars"}``: the cell runs in that context (or the
  language's default context, made on first use; no language is Python), and the answer streams one JSON object per
  line as the kernel produces it: ``{"type": "stdout"|"stderr", "text", "timestamp"}`` (Unix nanoseconds),
  ``{"type": "result", "text", "html", "png", ..., "is_main_result"}`` (a cell's value is the main result, a
  ``display()``/figure is not), ``{"type": "error", "name", "value", "traceback"}``, and last
  ``{"type": "number_of_executions", "execution_count"}``. ``env_vars`` hold for that cell only. A client that
  goes away interrupts the cell (``KeyboardInterrupt`` in the kernel). One cell runs at a time per context; others
  wait their turn.
- ``POST /contexts`` ``{"language", "cwd"}`` → ``{"id", "language", "cwd"}`` (``cwd`` defaults to the user's home);
  ``GET /contexts``; ``DELETE /contexts/<id>``; ``POST /contexts/<id>/restart`` (a new kernel: its variables go).
- Errors: ``{"error": message}`` with 400 (bad body, a language with no kernel here) or 404 (unknown context, path).

Kernels keep running between calls, and through a pause (sbx's stop with memory keeps their processes).
"""

from __future__ import annotations

import json
import os
import queue
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

PORT = int(os.environ.get("CODE_INTERPRETER_PORT", "49999"))
HOME = "/home/user"
"""The default context's directory (kernels run as root, as on E2B, in the user's home)."""
KERNEL_OPTIONS = ["--InteractiveShell.colors=NoColor", "--PlainTextFormatter.max_seq_length=0",
                  "--HistoryManager.enabled=False"]
"""A Python kernel's options: tracebacks without terminal colours, collections shown whole, and no history
database (its SQLite file lock, held while the kernel runs, makes a pause lose the sandbox's memory: CRIU refuses
to dump held file locks)."""
SETUP = """\
def _sbx_setup():
    import sys
    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

        def __call__(self, obj):
            pandas = sys.modules.get("pandas")  # a DataFrame exists only once pandas was imported
            if pandas is not None and isinstance(obj, pandas.DataFrame):
                columns = obj.to_dict(orient="list")
                return {str(k): [v.isoformat() if hasattr(v, "isoformat") else v for v in vs]
                        for k, vs in columns.items()}
            return super().__call__(obj)

    shell = get_ipython()
    shell.display_formatter.formatters["e2b/data"] = DataFormatter(parent=shell.display_formatter)

_sbx_setup()
del _sbx_setup
"""
"""Run quietly in each new Python kernel: a pandas DataFrame shown as a cell's value also gives its columns as
``data`` (``{"column": [values]}``), which E2B's SDK reads as ``Result.data``."""
SOCKETS = os.path.join(os.environ.get("RUNTIME_DIRECTORY") or "/tmp", "code-interpreter")
"""Where the kernels' Unix sockets live (the unit's ``RuntimeDirectory``)."""
UNHEARD = 30.0
"""Seconds a cell may go without the kernel saying it took it (its ``busy`` status comes at once) before the cell is
answered with an error rather than waited for forever."""
SANDBOX_ENV = "/etc/sbx/env.json"
"""The sandbox's environment as sbx writes it (a JSON object): the variables every kernel gets."""
LANGUAGES = {"python": "python3", "python3": "python3", "bash": "bash", "r": "ir", "javascript": "javascript",
             "js": "javascript", "typescript": "typescript", "ts": "typescript", "java": "java"}
"""E2B's language names -> the kernel spec each needs; only those installed are served (:func:`kernel_for`)."""

# a cell's result, by MIME type -> the field E2B's SDK reads it from
MIME = {"e2b/data": "data", "text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
        "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
        "application/json": "json", "application/javascript": "javascript"}


class Refused(Exception):
    """A request that can't be served: answered ``{"error": message}`` with ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def kernel_for(language: str | None) -> tuple[str, str]:
    """``(E2B language name, installed kernel spec name)`` for ``language`` (None: Python). Raises
    :class:`Refused` (400) for a language whose kernel this image does not have."""
    name = (language or "python").lower()
    spec = LANGUAGES.get(name, name)
    installed = KernelSpecManager().find_kernel_specs()
    if name == "bash" and spec not in installed and "python3" in installed:
        return "bash", "python3"  # cells run as IPython's %%bash (a shell per cell; no state between cells)
    if spec not in installed:
        have = sorted({k for k, v in LANGUAGES.items() if v in installed and k != "python3"} | {"bash"})
        raise Refused(400, f"no kernel for language {name!r} in this sandbox (it has: {', '.join(have)})")
    return ("python" if spec == "python3" else name), spec


class Context:
    """One kernel and the lock that lets one cell run in it at a time."""

    def __init__(self, language: str, spec: str, cwd: str):
        self.id = uuid.uuid4().hex
        self.language, self.spec, self.cwd = language, spec, cwd
        self.lock = threading.Lock()
        # Unix sockets, not loopback TCP, between this server and the kernel: a pause keeps both processes, and
        # a restore brings Unix sockets back connected where it resets TCP connections (sbx's CRIU config)
        os.makedirs(SOCKETS, mode=0o700, exist_ok=True)
        self.manager = KernelManager(kernel_name=spec, transport="ipc", ip=os.path.join(SOCKETS, self.id))
        self.client: Any = None
        self.env_stamp = 0
        self._start()

    def _start(self) -> None:
        self.manager.start_kernel(cwd=self.cwd, extra_arguments=KERNEL_OPTIONS if self.spec == "python3" else [])
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self._setup()

    def _setup(self) -> None:
        """What a new Python kernel runs before any cell: :data:`SETUP` (a DataFrame's columns as its ``data``)."""
        if self.spec == "python3":
            self._quiet(SETUP)

    def restart(self) -> None:
        """A fresh kernel in the same context (same id, language and cwd)."""
        with self.lock:
            self.client.stop_channels()
            self.manager.restart_kernel(now=True)
            self.client = self.manager.client()
            self.client.start_channels()
            self.client.wait_for_ready(timeout=60)
            self._setup()
            self.env_stamp = 0

    def shutdown(self) -> None:
        with self.lock:
            self.client.stop_channels()
            self.manager.shutdown_kernel(now=True)

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def _quiet(self, code: str) -> None:
        """Run ``code`` silently (no output, no history) and wait for its reply."""
        msg_id = self.client.execute(code, silent=True, store_history=False)
        while True:
            reply = self.client.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                return

    def _sandbox_env(self) -> None:
        """Set the sandbox's own variables (:data:`SANDBOX_ENV`, written by sbx at create: E2B's ``envs``) in the
        kernel, once per version of that file."""
        try:
            stamp = os.stat(SANDBOX_ENV).st_mtime_ns
            if stamp == self.env_stamp:
                return
            with open(SANDBOX_ENV) as f:
                env = {str(k): str(v) for k, v in json.load(f).items()}
        except (OSError, ValueError, AttributeError):
            return
        if env and self.spec == "python3":
            self._quiet("import os as _e2b_os\n_e2b_os.environ.update(%r)" % (env,))
        self.env_stamp = stamp

    def run(self, code: str, env: dict[str, str], emit: Any, gone: Any = lambda: False) -> None:
        """Run cell ``code`` with ``env`` set for it; ``emit(obj)`` gets each output line's object and raises
        ``OSError`` when the client is gone, and ``gone()`` says so while the cell is silent: either way the cell is
        interrupted and its remaining output dropped."""
        with self.lock:
            self._sandbox_env()
            python = self.spec == "python3"
            if env and python:
                self._quiet("import os as _e2b_os\n_e2b_saved = {k: _e2b_os.environ.get(k) for k in %r}\n"
                            "_e2b_os.environ.update(%r)" % (sorted(env), env))
            if self.language == "bash" and python:
                code = "%%bash\n" + code
            try:
                self._stream(code, emit, gone)
            finally:
                if env and python:
                    self._quiet("for _k, _v in _e2b_saved.items():\n"
                                "    _e2b_os.environ.pop(_k, None) if _v is None else "
                                "_e2b_os.environ.__setitem__(_k, _v)\ndel _e2b_saved, _k, _v")

    def _stream(self, code: str, emit: Any, client_gone: Any) -> None:
        msg_id = self.client.execute(code, store_history=True)
        sent = time.monotonic()
        count: int | None = None
        gone = heard = False
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=1)
            except queue.Empty:
                if not heard and time.monotonic() - sent > UNHEARD:
                    if not gone:
                        emit({"type": "error", "name": "KernelUnresponsive", "value": "the kernel did not take the "
                              f"cell within {UNHEARD:.0f} s", "traceback": "restart the context to get a new kernel"})
                    return
                if not gone and client_gone():
                    gone = True
                    self.manager.interrupt_kernel()
                if not self.manager.is_alive():
                    if not gone:
                        emit({"type": "error", "name": "KernelDied", "value": "the kernel ended",
                              "traceback": "the kernel process ended while the cell ran"})
                    return
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            heard = True
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                break
            out: dict[str, Any] | None = None
            if kind == "stream":
                out = {"type": "stdout" if content["name"] == "stdout" else "stderr", "text": content["text"],
                       "timestamp": time.time_ns()}
            elif kind in ("execute_result", "display_data"):
                out = {"type": "result", "is_main_result": kind == "execute_result"}
                extra = {}
                for mime, value in content.get("data", {}).items():
                    if mime in MIME:
                        out[MIME[mime]] = value
                    else:
                        extra[mime] = value
                text = out.get("text")
                if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
                    out["text"] = text[1:-1]  # a string's value reads as the string, as on E2B
                if extra:
                    out["extra"] = extra
            elif kind == "error":
                out = {"type": "error", "name": content["ename"], "value": content["evalue"],
                       "traceback": "\n".join(content.get("traceback", []))}
            elif kind == "execute_input":
                count = content.get("execution_count")
            if out is not None and not gone:
                try:
                    emit(out)
                except OSError:
                    gone = True  # the caller went away: stop the cell, drain its messages until idle
                    self.manager.interrupt_kernel()
        if count is not None and not gone:
            emit({"type": "number_of_executions", "execution_count": count})


class Contexts:
    """Every context of this sandbox, and each language's default one."""

    def __init__(self) -> None:
        self.by_id: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}
        self.lock = threading.Lock()

    def create(self, language: str | None, cwd: str | None) -> Context:
        lang, spec = kernel_for(language)
        cwd = cwd or HOME
        if not os.path.isdir(cwd):
            raise Refused(400, f"cwd {cwd!r} is not a directory in this sandbox")
        ctx = Context(lang, spec, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def default(self, language: str | None) -> Context:
        lang, _spec = kernel_for(language)
        with self.lock:
            found = self.by_id.get(self.defaults.get(lang, ""))
        if found is not None:
            return found
        ctx = self.create(lang, HOME)
        with self.lock:
            self.defaults.setdefault(lang, ctx.id)
            kept = self.by_id[self.defaults[lang]]
        if kept is not ctx:  # another request made it meanwhile
            self.remove(ctx.id)
        return kept

    def get(self, context_id: str) -> Context:
        with self.lock:
            ctx = self.by_id.get(context_id)
        if ctx is None:
            raise Refused(404, f"no context {context_id!r}")
        return ctx

    def remove(self, context_id: str) -> None:
        ctx = self.get(context_id)
        with self.lock:
            self.by_id.pop(context_id, None)
            for lang, cid in list(self.defaults.items()):
                if cid == context_id:
                    del self.defaults[lang]
        ctx.shutdown()


CONTEXTS = Contexts()


class Handler(BaseHTTPRequestHandler):
    """One HTTP/1.1 request (see the module's doc)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError as e:
            raise Refused(400, f"the body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        return body

    def _answer(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if not isinstance(obj, bytes) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _serve(self, method: str) -> None:
        try:
            self._route(method)
        except Refused as e:
            self._answer(e.status, {"error": e.message})
        except (OSError, RuntimeError) as e:  # a kernel that would not start (e.g. in a cwd it may not enter)
            self._answer(500, {"error": f"{type(e).__name__}: {e}"})
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        if method == "GET" and path == "/health":
            self._answer(200, b"OK")
        elif method == "POST" and path == "/execute":
            self._execute(self._body())
        elif path == "/contexts" and method == "POST":
            body = self._body()
            ctx = CONTEXTS.create(_text(body, "language"), _text(body, "cwd"))
            self._answer(200, ctx.describe())
        elif path == "/contexts" and method == "GET":
            with CONTEXTS.lock:
                found = list(CONTEXTS.by_id.values())
            self._answer(200, [c.describe() for c in found])
        elif len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
            CONTEXTS.remove(parts[1])
            self._answer(200, {})
        elif len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
            CONTEXTS.get(parts[1]).restart()
            self._answer(200, {})
        else:
            raise Refused(404, f"no route {method} {path}")

    def _client_gone(self) -> bool:
        """Whether the client closed its side (its socket reads as EOF) while a cell runs."""
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _execute(self, body: dict[str, Any]) -> None:
        code = body.get("code")
        if not isinstance(code, str):
            raise Refused(400, "code must be a string")
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise Refused(400, "env_vars must map strings to strings")
        context_id, language = _text(body, "context_id"), _text(body, "language")
        if context_id and language:
            raise Refused(400, "give a context_id or a language, not both")
        ctx = CONTEXTS.get(context_id) if context_id else CONTEXTS.default(language)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def emit(obj: dict[str, Any]) -> None:
            line = json.dumps(obj).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()

        ctx.run(code, env, emit, self._client_gone)
        try:
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True


def _text(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise Refused(400, f"{key} must be a string")
    return value or None


def main() -> None:
    """Serve on ``0.0.0.0:49999`` (``CODE_INTERPRETER_PORT``), with the Python context started first."""
    server = ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    server.daemon_threads = True
    threading.Thread(target=CONTEXTS.default, args=(None,), daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
