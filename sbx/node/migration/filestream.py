"""A folder of files as one HTTP body, for moving a sandbox between nodes (:mod:`sbx.node.migration.outgoing`).

Format (little-endian), streamed without knowing the total length in advance::

    b"SBXFILES" u16 version=1
    per file:  u16 name length, name (UTF-8, one path component), u64 size, ``size`` bytes
    end:       u16 0, then 32 bytes: SHA-256 of every byte before them

:func:`pack` yields the body in chunks read from the files (a CRIU image of 128 MiB is ~146 MiB: nothing is held
in memory); :class:`Unpacker` is fed the body as it arrives and writes each file into a folder, so the receiver
needs no temporary copy. A name with ``/``, ``..`` or a NUL, a short body, extra bytes or a wrong checksum fails
with :class:`StreamError` and the caller removes the folder.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

MAGIC = b"SBXFILES"
VERSION = 1
CHUNK = 1 << 20
_HEAD = struct.Struct("<8sH")
_NAME = struct.Struct("<H")
_SIZE = struct.Struct("<Q")


class StreamError(Exception):
    """A file stream that is damaged or cut short (the message says where)."""


def pack(files: list[Path]) -> Iterator[bytes]:
    """The body for ``files`` (regular files; each is sent under its own name, so names must differ), in chunks
    of at most 1 MiB. Raises ``OSError`` when a file can't be read, ``ValueError`` for a duplicate name."""
    if len({f.name for f in files}) != len(files):
        raise ValueError("two files of one stream have the same name")
    h = hashlib.sha256()

    def out(b: bytes) -> bytes:
        h.update(b)
        return b

    yield out(_HEAD.pack(MAGIC, VERSION))
    for f in files:
        name = f.name.encode()
        with open(f, "rb", buffering=0) as src:
            size = os.fstat(src.fileno()).st_size
            yield out(_NAME.pack(len(name)) + name + _SIZE.pack(size))
            left = size
            while left:
                chunk = src.read(min(CHUNK, left))
                if not chunk:
                    raise OSError(f"{f} shrank while being sent")
                left -= len(chunk)
                yield out(chunk)
    yield out(_NAME.pack(0))
    yield h.digest()


class Unpacker:
    """Writes a stream of :func:`pack` into the folder ``dest`` (which must exist) as it is fed. ``files`` maps
    each name written to its size, once :meth:`close` succeeded."""

    def __init__(self, dest: Path, mode: int = 0o600):
        self.dest = dest
        self.mode = mode
        self.files: dict[str, int] = {}
        self._h = hashlib.sha256()
        self._buf = bytearray()
        self._state = "head"
        self._fd: int | None = None
        self._left = 0
        self._name = ""
        self._done = False

    def _take(self, n: int) -> bytes | None:
        if len(self._buf) < n:
            return None
        b = bytes(self._buf[:n])
        del self._buf[:n]
        if self._state != "digest":
            self._h.update(b)
        return b

    def feed(self, data: bytes) -> None:
        """Consume the next bytes of the body. Raises :class:`StreamError`, ``OSError`` (writing)."""
        if self._done and data:
            raise StreamError("bytes after the end of the stream")
        if self._state == "data" and not self._buf:
            data = self._write(data)
        self._buf += data
        while not self._done:
            if self._state == "head":
                b = self._take(_HEAD.size)
                if b is None:
                    return
                magic, version = _HEAD.unpack(b)
                if magic != MAGIC or version != VERSION:
                    raise StreamError("not an sbx file stream of version 1")
                self._state = "name"
            elif self._state == "name":
                if len(self._buf) < _NAME.size:
                    return
                (n,) = _NAME.unpack(self._buf[:_NAME.size])
                if n == 0:
                    self._take(_NAME.size)
                    self._state = "digest"
                    continue
                if len(self._buf) < _NAME.size + n + _SIZE.size:
                    return
                self._take(_NAME.size)
                raw = self._take(n)
                assert raw is not None
                size_b = self._take(_SIZE.size)
                assert size_b is not None
                name = raw.decode(errors="replace")
                if not name or "/" in name or "\0" in name or name in (".", "..") or name in self.files:
                    raise StreamError(f"bad file name {name!r} in the stream")
                (self._left,) = _SIZE.unpack(size_b)
                self._name = name
                self._fd = os.open(self.dest / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.mode)
                self.files[name] = self._left
                self._state = "data"
                if not self._left:
                    self._end_file()
            elif self._state == "data":
                if not self._buf:
                    return
                rest = self._write(bytes(self._buf))
                self._buf = bytearray(rest)
            elif self._state == "digest":
                if len(self._buf) < 32:
                    return
                digest = bytes(self._buf[:32])
                del self._buf[:32]
                if digest != self._h.digest():
                    raise StreamError("checksum mismatch")
                if self._buf:
                    raise StreamError("bytes after the end of the stream")
                self._done = True

    def _write(self, data: bytes) -> bytes:
        """Write up to the rest of the current file from ``data``; returns what is left over."""
        assert self._fd is not None
        n = min(len(data), self._left)
        view = memoryview(data)[:n]
        self._h.update(view)
        while view:
            view = view[os.write(self._fd, view):]
        self._left -= n
        if not self._left:
            self._end_file()
        return data[n:]

    def _end_file(self) -> None:
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None
        self._state = "name"

    def close_quietly(self) -> None:
        """Close the file being written, if any (after a failure)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        """The body ended: raise :class:`StreamError` unless the stream was complete."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self._done:
            raise StreamError(f"the stream ended early (in {self._name or 'its header'})")
