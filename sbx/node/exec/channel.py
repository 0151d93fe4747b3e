"""The exec channel: the host's side of the connection to a sandbox's exec agent (``sbx-agent``, in the guest
image: ``sbx/guest/files/usr/lib/sbx/sbx-agent``).

A ``runc exec`` costs ~20 ms of runc and CRIU-free setup per command; the agent, a process of the sandbox's own
systemd, starts the command itself, so a round trip is a connect and a fork. The agent listens on
``/run/sbx-agent/agent.sock`` in the sandbox's mount namespace; the node reaches it through the container init's
root (``/proc/<init pid>/root``, the pid and start time from runc's ``state.json``), resolving the path with
``openat2(RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)``, so nothing the sandbox puts on that
path (a symlink, a magic link) can lead the node to a socket outside the sandbox. Only a socket inode is
connected to. The listening socket is part of the sandbox's memory and comes back with a restore; a connection
is not, so a stop closes every open one first (:meth:`sbx.node.exec.jobs.ExecMixin._quiesce_channel`).

Everything the agent sends is untrusted (the sandbox's root can kill or replace it): the hello must be exact and
arrive within :data:`HELLO_TIMEOUT`, frames are at most :data:`MAX_FRAME` bytes of known types, an exit code is an
integer 0..255, and nothing it says (a pid, a path) is ever used on the host. The node falls back to ``runc
exec`` when the agent can't be reached, does not greet, or says it could not start the command; after a
misbehaving answer the sandbox gets ``runc exec`` only, for :data:`SUSPECT_SECONDS`.

Frames both ways: one type byte, a 4-byte big-endian length, the payload (see the agent's docstring).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path

AGENT_SOCKET = "run/sbx-agent/agent.sock"
"""The agent's socket, relative to the sandbox's root."""
HELLO = b"sbx-agent 1"
HELLO_TIMEOUT = 2.0
"""Seconds the agent has to greet after the connect (it does so at once)."""
MAX_FRAME = 1 << 20
"""Largest frame payload accepted from the agent (it sends at most 64 KiB of output per frame)."""
SUSPECT_SECONDS = 60.0
HDR = struct.Struct(">cI")

_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_IN_ROOT = 0x10
_OPENAT2 = {"x86_64": 437, "aarch64": 437}
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class Unavailable(Exception):
    """The agent can't be used for this command: use ``runc exec``. ``suspect``: something answered but not as the
    agent does (no hello in time, a wrong one), so it is not asked again for a while."""

    def __init__(self, message: str, suspect: bool = False):
        super().__init__(message)
        self.suspect = suspect


class ProtocolError(Exception):
    """The agent sent something that is not the protocol (after it had greeted)."""


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    """One frame: type byte ``kind``, big-endian length, ``payload``."""
    return HDR.pack(kind, len(payload)) + payload


def _openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    nr = _OPENAT2.get(platform.machine())
    if nr is None:
        raise Unavailable(f"openat2 has no known syscall number on {platform.machine()}")
    how = _OpenHow(flags, 0, resolve)
    fd = _libc.syscall(nr, dirfd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)


def _init(state_file: Path) -> tuple[int, int]:
    """``(pid, start time)`` of the container init from runc's ``state.json``; raises :class:`Unavailable`."""
    try:
        state = json.loads(state_file.read_text())
        return int(state["init_process_pid"]), int(state["init_process_start"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Unavailable(f"no container state: {e}") from e


def _start_time(pid: int) -> int:
    stat_line = Path(f"/proc/{pid}/stat").read_text()
    return int(stat_line[stat_line.rindex(")") + 2:].split()[19])


def connect(state_file: Path, timeout: float = HELLO_TIMEOUT) -> socket.socket:
    """A connected, greeted socket to the agent of the container whose runc state is ``state_file``
    (``<runc root>/<id>/state.json``). Raises :class:`Unavailable` when there is no agent to talk to (no
    container, no socket, refused, no hello within ``timeout`` seconds, a wrong hello)."""
    pid, start = _init(state_file)
    try:
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise Unavailable(f"container init {pid}: {e}") from e
    try:
        if _start_time(pid) != start:  # the pid was reused between reading the state and opening its root
            raise Unavailable("the container init changed")
        fd = _openat2(root, AGENT_SOCKET, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW,
                      _RESOLVE_IN_ROOT | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    except OSError as e:
        raise Unavailable(f"agent socket: {e}") from e
    finally:
        os.close(root)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise Unavailable("the agent path is not a socket")
        sock.settimeout(timeout)
        try:
            sock.connect(f"/proc/self/fd/{fd}")
        except OSError as e:
            raise Unavailable(f"agent: {e}") from e
        try:
            got = _recv_exact(sock, HDR.size + len(HELLO))
        except (OSError, TimeoutError) as e:
            raise Unavailable(f"no hello from the agent: {e}", suspect=True) from e
        if got != frame(b"H", HELLO):
            raise Unavailable("the agent's hello is wrong", suspect=True)
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(fd)
    return sock


def relay_token(read: Callable[[], bytes]) -> bytes:
    """The relay token ``read()`` gives (the sandbox's ``/etc/sbx/relay-token``, read from its disk). Raises
    :class:`Unavailable` when there is none or it is not a token."""
    try:
        token = read().strip()
    except Exception as e:  # missing, unreadable, a symlink where the file should be
        raise Unavailable(f"no relay token: {e}") from e
    if len(token) < 16 or not token.isalnum():
        raise Unavailable("no relay token")
    return token


def connect_relay(address: str, port: int, token: bytes, timeout: float = HELLO_TIMEOUT) -> socket.socket:
    """A connected, greeted socket to the agent of a gvisor sandbox through its relay (``sbx-relay``) at
    ``address:port``, after sending ``token`` and a newline. Raises :class:`Unavailable` as :func:`connect` does
    (nothing listening, refused, or closed before a hello: the relay is not up or the agent's socket not yet there,
    right after a boot: not suspect; no hello in time or a wrong one: suspect)."""
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except OSError as e:
        raise Unavailable(f"relay {address}:{port}: {e}") from e
    try:
        sock.sendall(token + b"\n")
        try:
            got = _recv_exact(sock, HDR.size + len(HELLO))
        except TimeoutError as e:
            raise Unavailable(f"no hello from the agent through the relay: {e}", suspect=True) from e
        except OSError as e:
            raise Unavailable(f"the relay closed the connection: {e}") from e
        if got != frame(b"H", HELLO):
            raise Unavailable("the agent's hello through the relay is wrong", suspect=True)
    except BaseException:
        sock.close()
        raise
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise OSError(errno.ECONNRESET, "the agent closed the connection")
        buf += chunk
    return buf


class Frames:
    """Incremental parser of the agent's frames: :meth:`feed` bytes, get ``(kind, payload)`` pairs. Raises
    :class:`ProtocolError` for an unknown type or a payload over :data:`MAX_FRAME`."""

    KINDS = {b"S", b"F", b"o", b"e", b"x"}

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._buf += data
        out = []
        while len(self._buf) >= HDR.size:
            kind, n = HDR.unpack_from(self._buf)
            if kind not in self.KINDS or n > MAX_FRAME:
                raise ProtocolError(f"bad frame from the agent (type {kind!r}, {n} bytes)")
            if len(self._buf) < HDR.size + n:
                break
            out.append((kind, bytes(self._buf[HDR.size:HDR.size + n])))
            del self._buf[:HDR.size + n]
        return out


def exit_code(payload: bytes) -> int:
    """The exit code of an ``x`` frame: an ASCII integer 0..255; raises :class:`ProtocolError` otherwise."""
    text = payload.decode("ascii", "replace")
    if not text.isdigit() or not 0 <= int(text) <= 255:
        raise ProtocolError(f"bad exit code from the agent: {text[:20]!r}")
    return int(text)
