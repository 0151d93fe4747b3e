"""``sbx ssh ID [-- CMD...]``: a terminal in the sandbox through the API's PTY WebSocket (no sshd or keys needed).

Without a command it is a login shell (``bash -l``) as ``user``; with one, ``bash -lc CMD`` in a pseudo-terminal,
and ``sbx ssh`` exits with the command's exit code. When stdin is a terminal it is put in raw mode (restored at the
end) and window-size changes are passed on; otherwise stdin is forwarded as it is and its end sends ^D.
:func:`run_pty` is shared with ``sbx exec -t``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import termios
import threading
import tty
from typing import Any
from urllib.parse import urlencode

import typer

from sbx.cli.common import client, fail, handle_errors


def _ws_url(http_url: str, path: str, params: dict[str, Any]) -> str:
    base = "ws" + http_url[len("http"):] if http_url.startswith("http") else http_url
    return f"{base}{path}?{urlencode({k: v for k, v in params.items() if v is not None})}"


def run_pty(sandbox_id: str, command: str | None, user: str = "user") -> int:
    """Open a PTY session in the sandbox and relay it to this terminal; returns the remote exit code. Raises
    ``typer.Exit(1)`` with ``error: code: message`` when the session cannot start."""
    from websockets.exceptions import ConnectionClosed, InvalidHandshake
    from websockets.sync.client import connect

    with client() as c:
        cfg = c.config
    stdin_tty = sys.stdin.isatty()
    cols, rows = shutil.get_terminal_size((80, 24))
    url = _ws_url(cfg.url, f"/v1/sandboxes/{sandbox_id}/pty", {
        "command": command, "user": user, "cols": cols, "rows": rows, "term": os.environ.get("TERM") or None,
    })
    try:
        ws = connect(url, additional_headers={"Authorization": f"Bearer {cfg.token}"}, max_size=None,
                     open_timeout=30, close_timeout=5)
    except (OSError, InvalidHandshake, TimeoutError) as e:
        raise fail("unreachable", f"cannot open a terminal at {cfg.url}: {e}") from None

    fd = sys.stdin.fileno() if stdin_tty else -1
    saved = termios.tcgetattr(fd) if stdin_tty else None
    old_winch = None
    code: int | None = None
    error: tuple[str, str] | None = None
    try:
        if stdin_tty:
            tty.setraw(fd)

            def on_winch(_sig: int, _frame: Any) -> None:
                c2, r2 = shutil.get_terminal_size((80, 24))
                with contextlib.suppress(Exception):
                    ws.send(json.dumps({"type": "resize", "cols": c2, "rows": r2}))

            old_winch = signal.signal(signal.SIGWINCH, on_winch)

        def pump_stdin() -> None:
            try:
                while True:
                    data = os.read(sys.stdin.fileno(), 65536)
                    if not data:
                        if not stdin_tty:
                            ws.send(json.dumps({"type": "eof"}))
                        return
                    ws.send(data)
            except (OSError, ConnectionClosed, ValueError):
                return

        threading.Thread(target=pump_stdin, name="sbx-ssh-stdin", daemon=True).start()
        out = sys.stdout.buffer
        try:
            for msg in ws:
                if isinstance(msg, bytes):
                    out.write(msg)
                    out.flush()
                    continue
                try:
                    ctl = json.loads(msg)
                except ValueError:
                    continue
                if ctl.get("type") == "exit":
                    code = int(ctl.get("exitCode", 255))
                    break
                if ctl.get("type") == "error":
                    error = (str(ctl.get("code")), str(ctl.get("message")))
                    break
        except ConnectionClosed:
            pass
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        if old_winch is not None:
            signal.signal(signal.SIGWINCH, old_winch)
        with contextlib.suppress(Exception):
            ws.close()
    if error is not None:
        raise fail(*error)
    if code is None:
        raise fail("disconnected", "the terminal session ended without an exit status")
    return code


@handle_errors
def ssh(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    command: list[str] = typer.Argument(None, help="A command to run instead of a login shell (after --)."),
    user: str = typer.Option("user", "--user", "-u", help="user (default) or root."),
) -> None:
    """Open a shell in the sandbox (a login shell as `user`), or run `-- CMD` in a terminal and exit with its
    code."""
    cmd = " ".join(command) if command else None
    raise typer.Exit(run_pty(sandbox_id, cmd, user))
