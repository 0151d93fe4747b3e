"""Build contexts as tar streams: :func:`pack_context` makes one of a folder, :func:`unpack_context` unpacks one
safely.

A build context crosses two hops before it reaches buildah: the client to the API (``POST /v1/images/build``) and,
when the server's node is another machine, the server to that node. Both unpack with :func:`unpack_context`, which
takes only regular files, folders and relative symlinks that stay inside the destination: no absolute or ``..``
names, no hard links, devices, FIFOs or sockets; permission bits kept (at most ``0755``), owners not. Python 3.11.2
(Debian 12) has no ``tarfile`` extraction filter, hence the checks here.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import IO


class BadContext(ValueError):
    """The tar is unreadable or holds something :func:`unpack_context` does not unpack (the message says what)."""


def unpack_context(tar_path: Path, dest: Path) -> None:
    """Unpack the tar at ``tar_path`` into the new folder ``dest`` (made ``0700``). Raises :class:`BadContext`;
    what was unpacked before the fault stays in ``dest`` for the caller to remove."""
    dest.mkdir(mode=0o700)
    root = dest.resolve()
    try:
        with tarfile.open(tar_path) as tf:
            for m in tf:
                _unpack_member(tf, m, root)
    except (tarfile.TarError, OSError) as e:
        raise BadContext(f"not a usable tar: {e}") from e


def _unpack_member(tf: tarfile.TarFile, m: tarfile.TarInfo, root: Path) -> None:
    rel = Path(m.name)
    if m.name in ("", ".", "./"):
        return
    if rel.is_absolute() or ".." in rel.parts:
        raise BadContext(f"{m.name!r} points outside the context")
    target = root / rel
    if not target.parent.resolve().is_relative_to(root):
        raise BadContext(f"{m.name!r} goes through a link out of the context")
    if m.isdir():
        target.mkdir(mode=0o755, parents=True, exist_ok=True)
    elif m.isfile():
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        src = tf.extractfile(m)
        assert src is not None
        with src, open(target, "wb") as f:
            shutil.copyfileobj(src, f)
        target.chmod(m.mode & 0o755)
    elif m.issym():
        link = Path(m.linkname)
        if link.is_absolute() or not (target.parent / link).resolve().is_relative_to(root):
            raise BadContext(f"link {m.name!r} points outside the context")
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        target.symlink_to(link)
    else:
        raise BadContext(f"{m.name!r} is not a file, folder or symlink")


def pack_context(folder: Path) -> IO[bytes]:
    """The folder ``folder`` as an uncompressed tar (names relative to it) in a temporary file, rewound."""
    f = tempfile.TemporaryFile()
    with tarfile.open(fileobj=f, mode="w") as tf:
        for entry in sorted(folder.iterdir()):
            tf.add(entry, arcname=entry.name)
    f.seek(0)
    return f
