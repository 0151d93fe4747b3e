"""Files in and out of a running sandbox: read, write, list, stat, remove, and tar streams of directories.

Every operation runs a small program *inside* the sandbox through :meth:`sbx.node.types.NodeAgent.spawn`
(``cat``, ``tar``, ``find``, ``rm`` as the sandbox's ``user`` or ``root``), so a path is resolved only in the
sandbox's own mount namespace: a symlink in the sandbox pointing at ``/etc/shadow`` names the sandbox's file, never
the host's, and no host path ever follows a sandbox symlink. Paths are argv entries (never shell text); a leading
``~`` is the user's home, a relative path is relative to it.

Errors (:class:`ControlError`): 400 ``invalid_path`` / ``invalid_user`` / ``is_a_directory`` /
``not_a_directory``, 403 ``permission_denied``, 404 ``not_found``, 409 ``not_running`` (with the state), 502
``file_error`` for anything else the sandbox reports.

Streams: :meth:`Files.open_read` returns an iterator of byte chunks (:data:`CHUNK` bytes at most) that has already
checked the path, so an API can choose its status before the first byte; :meth:`Files.open_write` returns a writer
that takes chunks and reports the outcome at :meth:`FileWriter.finish`. Nothing is held in memory whole.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from typing import Any, Protocol

from sbx.control.errors import ControlError
from sbx.control.sandboxes import filescripts as S
from sbx.control.sandboxes.activity import Activity
from sbx.control.store.database import SandboxRow
from sbx.node.types import NodeAgent, NodeError

log = logging.getLogger("sbx.control")

CHUNK = 1 << 20
USERS = ("user", "root")
NAME_MAX_BYTES = 255
"""Longest file name (one path component), in bytes, as ext4 allows."""

_TYPES = {"f": "file", "d": "directory", "l": "symlink", "p": "fifo", "s": "socket", "c": "char", "b": "block"}


def home_of(user: str) -> str:
    """The home directory of sandbox user ``user`` (``/root`` for root, else ``/home/user``)."""
    return "/root" if user == "root" else "/home/user"


def norm_path(path: str, user: str, field: str = "path") -> str:
    """``path`` with a leading ``~`` made ``user``'s home (a relative path stays relative: the programs run in
    the home directory, and a test's fake node runs them in a scratch folder). Raises 400
    ``invalid_<field>`` for an empty path, a NUL byte, more than 4096 bytes or a name (component) over
    :data:`NAME_MAX_BYTES` bytes, before anything runs in the sandbox."""
    raw = path.encode("utf-8", "surrogateescape") if path else b""
    if not path or "\0" in path or len(raw) > 4096:
        raise ControlError(f"invalid_{field}", f"{field} must be 1-4096 bytes without NUL bytes", 400, field=field)
    if any(len(part) > NAME_MAX_BYTES for part in raw.split(b"/")):
        raise ControlError(f"invalid_{field}", f"{field} has a name over {NAME_MAX_BYTES} bytes", 400, field=field)
    home = home_of(user)
    if path == "~":
        return home
    if path.startswith("~/"):
        return home + path[1:]
    return path


def _norm(path: str, user: str) -> str:
    return norm_path(path, user)


def _parse_entries(raw: bytes, parent: str | None) -> list[dict[str, Any]]:
    parts = raw.split(b"\0")
    entries = []
    for i in range(0, len(parts) - 1, 2):
        try:
            kind, size, mode, mtime = parts[i].decode().split(" ")
        except ValueError:
            continue
        name = parts[i + 1].decode("utf-8", "surrogateescape")
        entries.append({
            "name": name,
            "path": (parent.rstrip("/") + "/" + name) if parent is not None else name,
            "type": _TYPES.get(kind, "other"),
            "size": int(size),
            "mode": int(mode, 8),
            "mtime": float(mtime),
        })
    return entries


def _read_names(proc: subprocess.Popen[bytes], count: int) -> list[bytes]:
    """The first ``count`` NUL-terminated fields the program prints (fewer if it exits first)."""
    assert proc.stdout is not None
    fields: list[bytes] = []
    current = bytearray()
    while len(fields) < count:
        b = proc.stdout.read(1)
        if not b:
            break
        if b == b"\0":
            fields.append(bytes(current))
            current.clear()
        else:
            current += b
    return fields


class FileWriter:
    """An upload in progress: :meth:`write` chunks, then :meth:`finish` (or :meth:`abort`).

    For a file (``temp`` set), the chunks go to a temporary file next to the target, and :meth:`finish` renames it
    over the target; :meth:`abort` deletes it, leaving the target as it was."""

    def __init__(self, files: Files, sandbox_id: str, path: str, proc: subprocess.Popen[bytes],
                 user: str = "user", temp: bytes = b"", target: bytes = b""):
        self._files = files
        self.sandbox_id = sandbox_id
        self.path = path
        self.proc = proc
        self.user = user
        self.temp = temp
        self.target = target
        self.written = 0
        self._broken = False
        self.archive = False

    def write(self, chunk: bytes) -> None:
        """Pass ``chunk`` to the sandbox. After the program in the sandbox has failed, chunks are dropped (so the
        caller can drain its request and then get the error from :meth:`finish`)."""
        if self._broken or not chunk:
            return
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(chunk)
            self.written += len(chunk)
        except (BrokenPipeError, ValueError):
            self._broken = True

    def finish(self) -> int:
        """Close the stream and wait for the sandbox side; returns the bytes written. Raises the mapped error."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self._files._check(self.proc, self.path, archive=self.archive)
            if self.temp:
                self._files._run(self.sandbox_id, S.COMMIT, [_arg(self.temp), _arg(self.target)], self.user,
                                 self.path)
        finally:
            self._files._end(self.sandbox_id)
        return self.written

    def abort(self) -> None:
        """Kill the sandbox side (the client went away) and delete the temporary file: the target is unchanged.
        (A tar extraction cut short keeps the members it had written.)"""
        self._files._kill(self.proc)
        try:
            if self.temp:
                self._files._run(self.sandbox_id, S.DISCARD, [_arg(self.temp)], self.user, self.path)
        except ControlError as e:
            log.warning("could not remove %r in %s: %s", self.temp, self.sandbox_id, e.message)
        finally:
            self._files._end(self.sandbox_id)


def _arg(name: bytes) -> str:
    """A path the sandbox printed, back as an argv string (undecodable bytes round-trip)."""
    return name.decode("utf-8", "surrogateescape")


class FilesPlane(Protocol):
    """What :class:`Files` uses of its control plane (:class:`sbx.control.service.ControlPlane` is one)."""

    @property
    def node(self) -> NodeAgent: ...
    @property
    def activity(self) -> Activity: ...
    def wait_running(self, sandbox_id: str, row: SandboxRow | None = None) -> SandboxRow: ...


class Files:
    """File operations of a control plane (``control.files``). Each counts as activity while it runs."""

    def __init__(self, control: FilesPlane):
        self.control = control

    # plumbing --------------------------------------------------------------------------------------------------
    def _spawn(self, sandbox_id: str, script: str, args: list[str], user: str, stdin: bool = False
               ) -> subprocess.Popen[bytes]:
        if user not in USERS:
            raise ControlError("invalid_user", f"user must be one of {', '.join(USERS)}", 400)
        cp = self.control
        cp.wait_running(sandbox_id)
        cp.activity.begin(sandbox_id)
        try:
            return cp.node.spawn(sandbox_id, ["/bin/sh", "-c", script, "sbx", *args], user=user, stdin=stdin)
        except NodeError as e:
            cp.activity.end(sandbox_id)
            if e.code == "not_running":
                raise ControlError("not_running", e.message, 409, "stopped") from None
            raise ControlError(e.code, e.message, 404 if e.code == "not_found" else 502) from None

    def _end(self, sandbox_id: str) -> None:
        self.control.activity.end(sandbox_id)

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass

    @staticmethod
    def _raise(code: int, path: str, stderr: bytes, archive: bool = False) -> None:
        if code in S.ERRORS:
            name, status, msg = S.ERRORS[code]
            raise ControlError(name, msg.format(path=path), status, field="path")
        text = stderr.decode("utf-8", "replace").strip()[-500:]
        if "Permission denied" in text:
            raise ControlError("permission_denied", f"{path}: permission denied", 403)
        if "No space left" in text:
            raise ControlError("no_space", f"{path}: no space left on the sandbox's disk", 507)
        if "File name too long" in text:
            raise ControlError("invalid_path", f"{path}: a name is too long", 400, field="path")
        if archive:  # tar refused the body itself (not a tar, cut short, a bad member)
            raise ControlError("invalid_archive", f"the body is not a complete tar archive: {text[-200:]}", 400)
        raise ControlError("file_error", f"{path}: {text or f'failed with exit status {code}'}", 502)

    def _check(self, proc: subprocess.Popen[bytes], path: str, archive: bool = False) -> None:
        assert proc.stderr is not None
        stderr = proc.stderr.read()
        code = proc.wait()
        proc.stderr.close()
        if proc.stdout is not None:
            proc.stdout.close()
        if code != 0:
            self._raise(code, path, stderr, archive)

    def _run(self, sandbox_id: str, script: str, args: list[str], user: str, path: str) -> bytes:
        proc = self._spawn(sandbox_id, script, args, user)
        try:
            assert proc.stdout is not None
            out = proc.stdout.read()
            self._check(proc, path)
            return out
        finally:
            self._kill(proc)
            self._end(sandbox_id)

    def _stream(self, sandbox_id: str, script: str, args: list[str], user: str, path: str) -> Iterator[bytes]:
        proc = self._spawn(sandbox_id, script, args, user)
        assert proc.stdout is not None
        try:
            first = proc.stdout.read1(CHUNK)  # type: ignore[attr-defined]
            if not first:
                self._check(proc, path)
        except BaseException:
            self._kill(proc)
            self._end(sandbox_id)
            raise
        return self._rest(sandbox_id, proc, first, path)

    def _rest(self, sandbox_id: str, proc: subprocess.Popen[bytes], first: bytes, path: str) -> Iterator[bytes]:
        assert proc.stdout is not None
        try:
            if first:
                yield first
                while chunk := proc.stdout.read1(CHUNK):  # type: ignore[attr-defined]
                    yield chunk
                self._check(proc, path)
        finally:
            self._kill(proc)
            self._end(sandbox_id)

    # operations ------------------------------------------------------------------------------------------------
    def open_read(self, sandbox_id: str, path: str, user: str = "user") -> Iterator[bytes]:
        """The bytes of file ``path`` as chunks. The path is checked before this returns (404, 400
        ``is_a_directory``, 403, 409). An error after the first chunk ends the iterator with :class:`ControlError`
        (the caller's stream is cut short)."""
        p = _norm(path, user)
        return self._stream(sandbox_id, S.READ, [p], user, path)

    def open_tar(self, sandbox_id: str, path: str, user: str = "user") -> Iterator[bytes]:
        """A tar stream (POSIX tar, members relative to ``path``: ``./a``, ``./dir/b``) of directory ``path``."""
        p = _norm(path, user)
        return self._stream(sandbox_id, S.TAR_OUT, [p], user, path)

    def open_write(self, sandbox_id: str, path: str, user: str = "user") -> FileWriter:
        """Start writing file ``path`` (parent folders made, owned by ``user``). The target is replaced only when
        :meth:`FileWriter.finish` is called: an upload cut short leaves it as it was."""
        p = _norm(path, user)
        proc = self._spawn(sandbox_id, S.WRITE, [p], user, stdin=True)
        try:
            names = _read_names(proc, 2)
        except BaseException:
            self._kill(proc)
            self._end(sandbox_id)
            raise
        temp, target = names if len(names) == 2 else (b"", b"")
        return FileWriter(self, sandbox_id, path, proc, user, temp, target)

    def open_untar(self, sandbox_id: str, path: str, user: str = "user") -> FileWriter:
        """Start extracting a tar stream into directory ``path`` (made if missing; members owned by ``user``)."""
        p = _norm(path, user)
        writer = FileWriter(self, sandbox_id, path, self._spawn(sandbox_id, S.TAR_IN, [p], user, stdin=True))
        writer.archive = True
        return writer

    def list(self, sandbox_id: str, path: str, user: str = "user") -> list[dict[str, Any]]:
        """Entries of directory ``path``, sorted by name: ``{"name","path","type","size","mode","mtime"}`` (type
        ``file``/``directory``/``symlink``/...; size in bytes; mode the permission bits; mtime Unix seconds)."""
        p = _norm(path, user)
        raw = self._run(sandbox_id, S.LIST, [p, S.FIND_FMT], user, path)
        return sorted(_parse_entries(raw, p), key=lambda e: e["name"])

    def stat(self, sandbox_id: str, path: str, user: str = "user") -> dict[str, Any]:
        """One entry (as in :meth:`list`) for ``path``; a symlink given as ``path`` is followed when it resolves."""
        p = _norm(path, user)
        raw = self._run(sandbox_id, S.STAT, [p, S.FIND_FMT], user, path)
        entries = _parse_entries(raw, None)
        if not entries:
            raise ControlError("not_found", f"{path} not found", 404)
        entry = entries[0]
        entry["path"] = p
        entry["name"] = p.rstrip("/").rsplit("/", 1)[-1] or "/"
        return entry

    def check_dir(self, sandbox_id: str, path: str, user: str = "user", field: str = "cwd") -> str:
        """``path`` made absolute (as for files) once it is known to be a directory ``user`` can enter in the
        sandbox; else 400 ``invalid_<field>`` naming ``field``. Used for an exec's or a job's ``cwd``."""
        p = norm_path(path, user, field)
        try:
            self._run(sandbox_id, S.ISDIR, [p], user, path)
        except ControlError as e:
            if e.status >= 500 or e.code in ("not_running", "busy"):
                raise
            why = {"not_found": "does not exist", "not_a_directory": "is not a directory",
                   "permission_denied": f"cannot be entered by {user}"}.get(e.code, e.message)
            raise ControlError(f"invalid_{field}", f"{field} {path!r} {why}", 400, field=field) from None
        return p if p.startswith("/") else home_of(user) + "/" + p

    def remove(self, sandbox_id: str, path: str, user: str = "user") -> None:
        """Remove ``path`` (a directory with everything in it). Raises 404 when it does not exist, 403
        ``protected_path`` for ``/``, ``/home``, a home directory, a mount point or a folder holding one, 403
        ``permission_denied`` when anything in it could not be removed; either way before removing anything."""
        p = _norm(path, user)
        self._run(sandbox_id, S.REMOVE, [p], user, path)
