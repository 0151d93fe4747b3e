"""The file stream a sandbox's disk deltas and memory image cross between nodes in (sbx.node.migration.filestream):
what goes in comes out byte for byte whatever the chunking, and a damaged, cut or hostile stream is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sbx.node.migration.filestream import StreamError, Unpacker, pack


def _files(tmp: Path) -> list[Path]:
    src = tmp / "src"
    src.mkdir()
    out = []
    for name, size in (("pages-1.img", 3 << 20 | 17), ("empty.img", 0), ("core-1.img", 1000)):
        p = src / name
        p.write_bytes(os.urandom(size))
        out.append(p)
    return out


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 22])
def test_files_come_out_as_they_went_in(tmp_path: Path, chunk: int) -> None:
    files = _files(tmp_path)
    body = b"".join(pack(files))
    if chunk == 1:
        body_chunks = [body[i:i + 1] for i in range(0, min(len(body), 5000))] + [body[5000:]]
    else:
        body_chunks = [body[i:i + chunk] for i in range(0, len(body), chunk)]
    dest = tmp_path / "dest"
    dest.mkdir()
    u = Unpacker(dest, mode=0o644)
    for c in body_chunks:
        u.feed(c)
    u.close()
    assert sorted(u.files) == sorted(f.name for f in files)
    for f in files:
        assert (dest / f.name).read_bytes() == f.read_bytes()
        assert (dest / f.name).stat().st_mode & 0o777 == 0o644


def _unpack(tmp: Path, body: bytes) -> None:
    dest = tmp / "d"
    dest.mkdir(parents=True, exist_ok=True)
    u = Unpacker(dest)
    u.feed(body)
    u.close()


def test_a_damaged_cut_or_hostile_stream_is_refused(tmp_path: Path) -> None:
    body = b"".join(pack(_files(tmp_path)))
    flipped = bytearray(body)
    flipped[len(body) // 2] ^= 1
    with pytest.raises(StreamError, match="checksum"):
        _unpack(tmp_path / "a", bytes(flipped))
    with pytest.raises(StreamError, match="ended early"):
        _unpack(tmp_path / "b", body[:-40])
    with pytest.raises(StreamError, match="after the end"):
        _unpack(tmp_path / "c", body + b"x")
    with pytest.raises(StreamError, match="not an sbx file stream"):
        _unpack(tmp_path / "d", b"GARBAGE!" + body[8:])
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "x").write_bytes(b"hi")
    bad = b"".join(pack([evil / "x"])).replace(b"\x01\x00x", b"\x01\x00/")  # the name "x" becomes "/"
    with pytest.raises(StreamError, match="bad file name"):
        _unpack(tmp_path / "e", bad)
    assert not any((tmp_path / "e" / "d").iterdir())
