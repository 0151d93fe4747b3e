"""One SSH session relayed between the user's connection (to the gateway) and the sandbox's sshd.

The user's side is a :class:`DownSession` (asyncssh server session, bytes); once the user has asked for a shell, a
command or a subsystem (``sftp``), the gateway opens the same kind of session on its connection to the sandbox's
sshd (an :class:`UpSession`), with the user's terminal (type, size, modes) and environment (sshd keeps what its
``AcceptEnv`` allows: ``LANG`` and ``LC_*`` on Debian), and from then on passes along:

- stdin down → up; stdout and stderr up → down, each on its own stream; EOF both ways;
- window changes, signals and breaks from the user to the sandbox;
- the exit status (or exit signal) from the sandbox to the user, so ``ssh sb_x 'exit 3'`` exits 3;
- back-pressure: a side whose write buffer fills pauses reading on the other side.

Port forwarding (``direct-tcpip``, ``ssh -L``/``-D``) needs no code here: asyncssh tunnels those channels over the
connection to the sandbox's sshd itself (:meth:`sbx.api.sshgateway.server.GatewayConnection.connection_requested`).
If the sandbox cannot be reached (stopped without autoResume, gone, its sshd not answering) the session writes one
line to stderr and exits 255, as ``ssh`` does for a connection error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import asyncssh

log = logging.getLogger("sbx.sshgateway")

EXIT_UNREACHABLE = 255
"""The exit status of a session whose sandbox could not be reached (ssh's own for a failed connection)."""


EARLY_LIMIT = 1024 * 1024
"""Bytes of the user's input kept while the sandbox's side opens (a resume can take seconds); then reading pauses."""


class GatewayRefusal(Exception):
    """The session cannot reach the sandbox: ``str(e)`` is the line the user sees on stderr."""


class DownSession(asyncssh.SSHServerSession[bytes]):
    """The user's session. ``upstream`` opens (or returns) the connection to the sandbox's sshd and raises
    :class:`GatewayRefusal` when it can't."""

    def __init__(self, upstream: Callable[[], Awaitable[asyncssh.SSHClientConnection]]):
        self._upstream = upstream
        self._chan: asyncssh.SSHServerChannel[bytes] | None = None
        self._up: asyncssh.SSHClientChannel[bytes] | None = None
        self._pty: tuple[str, tuple[int, int, int, int], dict[int, int]] | None = None
        self._command: str | None = None
        self._subsystem: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._early: list[bytes] = []  # what the user sent before the sandbox's side was open
        self._early_bytes = 0
        self._early_eof = False

    # the user's requests ---------------------------------------------------------------------------------------
    def connection_made(self, chan: asyncssh.SSHServerChannel[bytes]) -> None:  # type: ignore[override]
        self._chan = chan

    def pty_requested(self, term_type: str, term_size: tuple[int, int, int, int],
                      term_modes: dict[int, int]) -> bool:  # type: ignore[override]
        self._pty = (term_type, term_size, dict(term_modes))
        return True

    def shell_requested(self) -> bool:
        return True

    def exec_requested(self, command: str) -> bool:
        self._command = command
        return True

    def subsystem_requested(self, subsystem: str) -> bool:
        self._subsystem = subsystem
        return True

    def session_started(self) -> None:
        # what the user sends until the sandbox's side is open is kept (up to EARLY_LIMIT, then reading pauses)
        self._task = asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        chan = self._chan
        assert chan is not None
        try:
            conn = await self._upstream()
            kw: dict[str, Any] = {"encoding": None}
            if self._subsystem is not None:
                kw["subsystem"] = self._subsystem
            elif self._command is not None:
                kw["command"] = self._command
            env = chan.get_environment_bytes()
            if env:
                kw["env"] = dict(env)  # a read-only mapping, which asyncssh would read as a list
            if self._pty is not None:
                term_type, size, modes = self._pty
                kw.update(request_pty="force", term_type=term_type or "xterm", term_size=size, term_modes=modes)
            else:
                kw["request_pty"] = False
            up, _ = await conn.create_session(lambda: UpSession(chan, self), **kw)
        except GatewayRefusal as e:
            self._fail(str(e))
            return
        except (asyncssh.Error, OSError) as e:
            log.info("ssh gateway: the sandbox refused a session: %s", e)
            self._fail(f"sbx: the sandbox's sshd refused the session: {e}")
            return
        except Exception as e:
            log.exception("ssh gateway: opening a session failed")
            self._fail(f"sbx: the gateway failed to open the session ({type(e).__name__})")
            return
        self._up = up
        with contextlib.suppress(OSError):
            for data in self._early:
                up.write(data)
            if self._early_eof:
                up.write_eof()
        paused = self._early_bytes >= EARLY_LIMIT
        self._early, self._early_bytes = [], 0
        if paused:
            chan.resume_reading()

    def _fail(self, message: str) -> None:
        chan = self._chan
        if chan is None:
            return
        with contextlib.suppress(Exception):
            chan.write_stderr((message.rstrip() + "\r\n" if self._pty else message.rstrip() + "\n").encode())
            chan.exit(EXIT_UNREACHABLE)

    # what the user sends along ----------------------------------------------------------------------------------
    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if self._up is not None:
            with contextlib.suppress(OSError):  # the sandbox's side closed: its connection_lost ends this one
                self._up.write(data)
            return
        self._early.append(data)
        self._early_bytes += len(data)
        if self._early_bytes >= EARLY_LIMIT and self._chan is not None:
            self._chan.pause_reading()

    def eof_received(self) -> bool:
        if self._up is not None:
            self._up.write_eof()
        else:
            self._early_eof = True
        return True  # half open: the sandbox's output still comes

    def terminal_size_changed(self, width: int, height: int, pixwidth: int, pixheight: int) -> None:
        if self._up is not None:
            with contextlib.suppress(Exception):
                self._up.change_terminal_size(width, height, pixwidth, pixheight)

    def signal_received(self, signal: str) -> None:
        if self._up is not None:
            with contextlib.suppress(Exception):
                self._up.send_signal(signal)

    def break_received(self, msec: int) -> bool:
        if self._up is not None:
            with contextlib.suppress(Exception):
                self._up.send_break(msec)
            return True
        return False

    def pause_writing(self) -> None:
        if self._up is not None:
            self._up.pause_reading()

    def resume_writing(self) -> None:
        if self._up is not None:
            self._up.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._up is not None:
            self._up.close()


class UpSession(asyncssh.SSHClientSession[bytes]):
    """The session on the sandbox's sshd: what it says goes to the user's channel ``down``."""

    def __init__(self, down: asyncssh.SSHServerChannel[bytes], session: DownSession):
        self._down = down
        self._session = session
        self._chan: asyncssh.SSHClientChannel[bytes] | None = None
        self._status: int | None = None
        self._signal: tuple[str, bool, str, str] | None = None

    def connection_made(self, chan: asyncssh.SSHClientChannel[bytes]) -> None:  # type: ignore[override]
        self._chan = chan

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        with contextlib.suppress(OSError):  # the user went away: DownSession.connection_lost closes this side
            if datatype == asyncssh.EXTENDED_DATA_STDERR:
                self._down.write_stderr(data)
            else:
                self._down.write(data)

    def eof_received(self) -> bool:
        with contextlib.suppress(Exception):
            self._down.write_eof()
        return True

    def exit_status_received(self, status: int) -> None:
        self._status = status

    def exit_signal_received(self, signal: str, core_dumped: bool, msg: str, lang: str) -> None:
        self._signal = (signal, core_dumped, msg, lang)

    def pause_writing(self) -> None:
        self._down.pause_reading()

    def resume_writing(self) -> None:
        self._down.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        down = self._down  # (its send side may be at EOF already: exit still sends the status, then closes)
        with contextlib.suppress(Exception):
            if self._signal is not None:
                down.exit_with_signal(*self._signal)
            elif self._status is not None:
                down.exit(self._status)
            else:  # the sandbox's sshd went away without an exit status (the sandbox stopped, sshd was killed)
                down.write_stderr(b"sbx: the sandbox closed the session\n")
                down.exit(EXIT_UNREACHABLE)
