"""``sbx cp``: copy files and directories between this machine and a sandbox (``ID:PATH`` names the sandbox side).

Files are streamed (never held whole in memory) and written inside the sandbox as ``user`` (or ``--user root``).
Directories travel as tar streams. Like ``cp -r``: copying onto an existing directory puts the source inside it.
``-`` as the local side is stdin/stdout (files only). Extraction here refuses members that would land outside the
target (absolute names, ``..``, paths through symlinks) and never changes ownership.
"""

from __future__ import annotations

import os
import re
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import typer

from sbx.cli.common import client, err, fail, handle_errors
from sbx.sdk import Client, SbxError
from sbx.sdk import filecalls as FC

CHUNK = 1 << 20
_REMOTE = re.compile(r"^(sb_[a-z0-9]{10}):(.*)$", re.S)


def parse_remote(spec: str) -> tuple[str, str] | None:
    """``"sb_abc1234567:~/x"`` -> ``("sb_abc1234567", "~/x")`` (an empty path is the home folder); else None."""
    m = _REMOTE.match(spec)
    if m is None:
        return None
    return m.group(1), m.group(2) or "~"


def _remote_stat(c: Client, sid: str, path: str, user: str) -> dict[str, Any] | None:
    try:
        return c.run(FC.stat_file(sid, path, user))  # type: ignore[no-any-return]
    except SbxError as e:
        if e.code == "not_found":
            return None
        raise


def _basename(path: str) -> str:
    return PurePosixPath(path.rstrip("/")).name or "root"


def _file_chunks(f: Any) -> Iterator[bytes]:
    while chunk := f.read(CHUNK):
        yield chunk


def _tar_stream(root: Path) -> Iterator[bytes]:
    """A POSIX tar stream of the folder ``root``'s contents (members ``./...``), made in a thread."""
    r, w = os.pipe()
    failure: list[BaseException] = []

    def produce() -> None:
        with os.fdopen(w, "wb") as wf:
            try:
                with tarfile.open(fileobj=wf, mode="w|", format=tarfile.PAX_FORMAT) as tf:
                    tf.add(str(root), arcname=".", recursive=True)
            except BrokenPipeError:
                pass
            except BaseException as e:  # reported after the stream ends
                failure.append(e)

    t = threading.Thread(target=produce, name="sbx-cp-tar", daemon=True)
    t.start()
    with os.fdopen(r, "rb") as rf:
        while chunk := rf.read(CHUNK):
            yield chunk
    t.join()
    if failure:
        raise SbxError("local_error", f"cannot read {root}: {failure[0]}")


def _inside(base: str, path: str) -> bool:
    return path == base or path.startswith(base.rstrip("/") + "/")


def _safe_members(tf: tarfile.TarFile, dest: Path) -> Iterator[tarfile.TarInfo]:
    base = os.path.realpath(dest)
    for m in tf:
        parts = PurePosixPath(m.name).parts
        if m.name.startswith("/") or ".." in parts or m.isdev() or m.isfifo():
            err.print(f"sbx cp: skipped unsafe member {m.name!r}", markup=False)
            continue
        parent = os.path.realpath(os.path.join(base, os.path.dirname(m.name)))
        if not _inside(base, parent):
            err.print(f"sbx cp: skipped {m.name!r} (it would leave the target through a symlink)", markup=False)
            continue
        if m.islnk():
            target = os.path.realpath(os.path.join(base, m.linkname))
            if m.linkname.startswith("/") or not _inside(base, target):
                err.print(f"sbx cp: skipped hard link {m.name!r}", markup=False)
                continue
        yield m


def _untar_into(dest: Path) -> tuple[Any, threading.Thread, list[BaseException]]:
    """A writable end whose bytes are extracted (safely) into ``dest`` by a thread."""
    r, w = os.pipe()
    failure: list[BaseException] = []

    def consume() -> None:
        with os.fdopen(r, "rb") as rf:
            try:
                with tarfile.open(fileobj=rf, mode="r|") as tf:
                    tf.chown = lambda *_a, **_k: None  # type: ignore[method-assign]
                    tf.extractall(str(dest), members=_safe_members(tf, dest))
            except BaseException as e:
                failure.append(e)
            finally:
                while rf.read(CHUNK):  # drain so the writer never blocks
                    pass

    t = threading.Thread(target=consume, name="sbx-cp-untar", daemon=True)
    t.start()
    return os.fdopen(w, "wb"), t, failure


def upload(c: Client, local: str, sid: str, path: str, user: str) -> None:
    """Copy local file or folder ``local`` (``-``: stdin) to ``path`` in the sandbox."""
    if local == "-":
        c.run(FC.write_file(sid, path, _file_chunks(sys.stdin.buffer), user))
        return
    src = Path(local)
    if not src.exists():
        raise SbxError("not_found", f"{local}: no such file or directory")
    st = _remote_stat(c, sid, path, user)
    into = (st is not None and st["type"] == "directory") or path.endswith("/")
    target = path.rstrip("/") + "/" + src.resolve().name if into else path
    if src.is_dir():
        c.run(FC.write_file(sid, target, _tar_stream(src), user, archive=True))
    else:
        with src.open("rb") as f:
            c.run(FC.write_file(sid, target, _file_chunks(f), user))


def download(c: Client, sid: str, path: str, local: str, user: str) -> None:
    """Copy file or folder ``path`` of the sandbox to ``local`` (``-``: stdout)."""
    if local == "-":
        out = sys.stdout.buffer
        c.run(FC.read_file(sid, path, user, out.write))
        out.flush()
        return
    st = _remote_stat(c, sid, path, user)
    if st is None:
        raise SbxError("not_found", f"{sid}:{path} not found")
    dst = Path(local)
    if dst.is_dir():
        dst = dst / _basename(path)
    if st["type"] == "directory":
        dst.mkdir(parents=True, exist_ok=True)
        w, t, failure = _untar_into(dst)
        try:
            with w:
                c.run(FC.read_file(sid, path, user, w.write, archive=True))
        except BrokenPipeError:
            pass
        t.join()
        if failure:
            raise SbxError("local_error", f"cannot extract into {dst}: {failure[0]}")
        return
    tmp = dst.with_name(f".{dst.name}.sbx-part")
    try:
        with tmp.open("wb") as f:
            c.run(FC.read_file(sid, path, user, f.write))
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


@handle_errors
def cp(
    src: str = typer.Argument(..., help="LOCAL or ID:PATH"),
    dst: str = typer.Argument(..., help="ID:PATH or LOCAL"),
    user: str = typer.Option("user", "--user", "-u", help="Read/write in the sandbox as user (default) or root."),
) -> None:
    """Copy a file or folder into a sandbox (sbx cp LOCAL ID:PATH) or out of it (sbx cp ID:PATH LOCAL). PATH is
    absolute or relative to the home folder; - is stdin/stdout."""
    r_src, r_dst = parse_remote(src), parse_remote(dst)
    if (r_src is None) == (r_dst is None):
        raise fail("invalid_request", "exactly one side must be ID:PATH (e.g. sbx cp ./a sb_x:~/a)")
    with client() as c:
        if r_dst is not None:
            upload(c, src, r_dst[0], r_dst[1], user)
        else:
            assert r_src is not None
            download(c, r_src[0], r_src[1], dst, user)
