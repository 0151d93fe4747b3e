"""The ``sbx`` console script (``sbx = sbx.cli.fast:main``): a fast path for a plain ``sbx exec``, else the full CLI.

Loading typer, rich and httpx takes ~0.15-0.3 s, several times what ``sbx exec ID true`` needs. So a call of the
form ``sbx exec ID WORDS... [--timeout S] [--user U] [--env K=V]... [--cwd D]`` against an ``http://`` server is
served here with the standard library: the same request (:func:`sbx.sdk.protocol.exec_`, base64 output) over one
HTTP/1.1 connection, the output written as it arrives, the command's exit code as the process's. Anything else
(other verbs, other options, ``--help``, a word that looks like an option, https, bad values) goes to the typer
app (:mod:`sbx.cli.main`), unchanged. So does every failure before the server accepted the command (no config,
connection refused, an HTTP error status): the full CLI then makes the same request and reports the error exactly
as it always has; nothing ran yet, so nothing runs twice.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from typing import Any

_VALUE_OPTS = {"--timeout": "timeout", "--user": "user", "-u": "user", "--env": "env", "-e": "env",
               "--cwd": "cwd"}
_ID_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_URL_RE = re.compile(r"^http://([^/:]+|\[[0-9a-fA-F:]+\])(?::(\d+))?(/.*)?$")
MAX_TIMEOUT = 7 * 86400  # the exec verb's --timeout bound


class _Fallback(Exception):
    """Not for the fast path: run the full CLI instead."""


def parse_exec(argv: list[str]) -> dict[str, Any]:
    """The exec call in ``argv`` (after ``sbx``) as ``{"id", "command", "timeout", "user", "env", "cwd"}``, with
    the defaults the exec verb applies; raises :class:`_Fallback` for anything the full CLI must judge."""
    if len(argv) < 3 or argv[0] != "exec":
        raise _Fallback
    opts: dict[str, Any] = {"timeout": None, "user": "user", "env": {}, "cwd": None}
    words: list[str] = []
    i = 1
    while i < len(argv):
        tok = argv[i]
        if tok in _VALUE_OPTS:
            if i + 1 >= len(argv):
                raise _Fallback
            value, name = argv[i + 1], _VALUE_OPTS[tok]
            if name == "env":
                key, sep, val = value.partition("=")
                if not sep or not key:
                    raise _Fallback
                opts["env"][key] = val
            elif name == "timeout":
                try:
                    t = float(value)
                except ValueError:
                    raise _Fallback from None
                if not 0 <= t <= MAX_TIMEOUT:
                    raise _Fallback
                opts["timeout"] = t
            else:
                opts[name] = value
            i += 2
            continue
        if tok.startswith("-"):  # --help, --json, --detach, --tty, --x=y, "--", "-n" of a command: typer decides
            raise _Fallback
        words.append(tok)
        i += 1
    if len(words) < 2 or not _ID_RE.match(words[0]):
        raise _Fallback
    return {"id": words[0], "command": " ".join(words[1:]), "timeout": opts["timeout"], "user": opts["user"],
            "env": opts["env"] or None, "cwd": opts["cwd"]}


class _Stream:
    """The answer of one HTTP/1.1 request on a plain socket: status, headers, then the body's lines."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""
        self.eof = False

    def _fill(self) -> bool:
        if self.eof:
            return False
        chunk = self.sock.recv(65536)
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def line(self) -> bytes | None:
        while b"\n" not in self.buf:
            if not self._fill():
                if self.buf:
                    rest, self.buf = self.buf, b""
                    return rest
                return None
        head, _, self.buf = self.buf.partition(b"\n")
        return head + b"\n"

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise OSError("the answer ended early")
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def head(self) -> tuple[int, dict[str, str]]:
        status_line = self.line() or b""
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise OSError("not an HTTP answer")
        headers: dict[str, str] = {}
        while True:
            raw = self.line()
            if raw is None:
                raise OSError("the answer ended in its headers")
            if raw in (b"\r\n", b"\n"):
                return int(parts[1]), headers
            key, _, value = raw.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()

    def body_lines(self, headers: dict[str, str]) -> Any:
        """The body's lines (bytes), de-chunked when ``Transfer-Encoding: chunked``."""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            pending = b""
            while True:
                size_line = self.line()
                if size_line is None:
                    raise OSError("the answer ended in a chunk")
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                pending += self.exact(size)
                self.exact(2)
                while b"\n" in pending:
                    head, _, pending = pending.partition(b"\n")
                    yield head
            if pending:
                yield pending
            return
        if "content-length" in headers:
            data = self.exact(int(headers["content-length"]))
            yield from data.split(b"\n")
            return
        while (raw := self.line()) is not None:
            yield raw.rstrip(b"\n")


def _binary_writer(stream: Any) -> Any:
    buf = stream.buffer

    def write(data: bytes) -> None:
        buf.write(data)
        buf.flush()

    return write


def run_exec(call: dict[str, Any]) -> int:
    """Run the parsed exec ``call`` over a plain connection and return the exit status for the process. Raises
    :class:`_Fallback` while nothing has run (the full CLI then repeats the request and reports what it meets)."""
    from sbx.sdk import protocol as P
    from sbx.sdk.config import load_config
    from sbx.sdk.errors import SbxError

    try:
        cfg = load_config()
    except SbxError:
        raise _Fallback from None
    m = _URL_RE.match(cfg.url)
    if not m:
        raise _Fallback
    host, port, prefix = m.group(1).strip("[]"), int(m.group(2) or 80), (m.group(3) or "").rstrip("/")
    timeout = 30.0 if call["timeout"] is None else call["timeout"]
    gen = P.exec_(call["id"], call["command"], timeout or None, call["user"], call["env"], call["cwd"],
                  _binary_writer(sys.stdout), _binary_writer(sys.stderr), binary=True)
    req = next(gen)
    body = json.dumps(req.body).encode()
    try:
        sock = socket.create_connection((host, port), timeout=10.0)
    except OSError:
        raise _Fallback from None
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = (f"{req.method} {prefix}{req.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Authorization: Bearer {cfg.token}\r\nUser-Agent: sbx-sdk\r\nAccept: */*\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        stream = _Stream(sock)
        try:
            sock.sendall(head.encode() + body)
            sock.settimeout(req.timeout)
            status, headers = stream.head()
        except OSError:
            raise _Fallback from None
        if status >= 400:
            raise _Fallback
        try:
            for raw in stream.body_lines(headers):
                obj = P.parse_line(raw.decode("utf-8", "replace"))
                if obj is not None and req.on_line is not None and req.on_line(obj):
                    break
            gen.send(P.Response(status))
        except StopIteration as done:
            res = done.value
        except SbxError as e:
            return _fail(e.code, e.message)
        except (OSError, ValueError) as e:
            return _fail("unreachable", f"cannot reach {cfg.url}: {e}")
        else:
            return _fail("bad_response", "the exec call did not end")
    if res.timed_out:
        from sbx.cli.common import err

        err.print(f"sbx: command timed out after {timeout or 0:g} s (exit 124); use --timeout or --detach",
                  markup=False)
    return int(res.exit_code)


def _fail(code: str, message: str) -> int:
    from sbx.cli.common import err

    err.print(f"error: {code}: {message}", markup=False)
    return 1


def main() -> None:
    """Entry point of the ``sbx`` command."""
    argv = sys.argv[1:]
    if not os.environ.get("SBX_CLI_NO_FAST"):
        try:
            call = parse_exec(argv)
            try:
                code = run_exec(call)
            except KeyboardInterrupt:  # as click reports an interrupted command
                sys.stderr.write("\nAborted!\n")
                code = 1
            sys.stdout.flush()
            raise SystemExit(code)
        except _Fallback:
            pass
    from sbx.cli.main import app

    app()
