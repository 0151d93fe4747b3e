"""sbx.runtime.criuimages: retargeting a CRIU image at another uid range and hostname, on images written here in
CRIU's layout (magic, then u32 length + protobuf message per entry)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from sbx.runtime import criuimages as ci
from sbx.runtime.base import RuntimeError_

OLD, NEW = 1_196_608, 1_262_144


def _msg(*fields: tuple[int, int | bytes]) -> bytes:
    return ci._encode([(n, 0 if isinstance(v, int) else 2, v) for n, v in fields])


def _write(path: Path, magic: int, entries: list[bytes]) -> None:
    path.write_bytes(struct.pack("<II", ci.IMG_COMMON_MAGIC, magic)
                     + b"".join(struct.pack("<I", len(e)) + e for e in entries))


def _image(tmp_path: Path) -> Path:
    d = tmp_path / "memory"
    d.mkdir()
    extent = _msg((1, 0), (2, OLD), (3, 65536))  # {first, lower_first, count}
    _write(d / "userns-14.img", 0x55474906, [_msg((1, extent), (2, extent))])
    perms = _msg((1, 0o755), (2, OLD + 100), (3, OLD + 101))  # cgroup_perms {mode, uid, gid}
    host_root = _msg((1, 0o644), (2, 0), (3, 0))  # a file the host owns: stays host root
    prop = _msg((1, b"memory.limit_in_bytes"), (2, b"268435456"), (3, host_root))
    cdir = _msg((1, b"init.scope"), (3, prop), (4, perms))
    _write(d / "cgroup.img", 0x59383330, [_msg((2, _msg((1, b"memory"), (2, cdir))))])
    _write(d / "utsns-12.img", ci.UTSNS_MAGIC, [_msg((1, b"sbx-template"), (2, b"(none)"))])
    return d


def test_retarget_moves_every_id_of_the_old_range_and_the_hostname(tmp_path):
    d = _image(tmp_path)
    assert ci.count_ids(d, OLD) == 4  # two extents, a folder's uid and gid
    assert ci.retarget(d, old_base=OLD, new_base=NEW, hostname="brisk-amber-heron") == 4
    assert ci.count_ids(d, OLD) == 0 and ci.count_ids(d, NEW) == 4
    data = (d / "cgroup.img").read_bytes()
    assert ci._enc_varint(NEW + 100) in data and ci._enc_varint(NEW + 101) in data
    assert b"memory.limit_in_bytes" in data and b"268435456" in data  # the rest is kept as it was
    _, entries = ci._read_entries(d / "utsns-12.img", ci.UTSNS_MAGIC)
    assert dict((n, v) for n, _w, v in ci._fields(entries[0])) == {1: b"brisk-amber-heron", 2: b"(none)"}


def test_retarget_to_the_same_base_changes_no_id(tmp_path):
    d = _image(tmp_path)
    before = (d / "userns-14.img").read_bytes()
    assert ci.retarget(d, old_base=OLD, new_base=OLD, hostname=None) == 0
    assert (d / "userns-14.img").read_bytes() == before


def test_a_damaged_image_is_an_error(tmp_path):
    d = tmp_path / "memory"
    d.mkdir()
    (d / "utsns-12.img").write_bytes(struct.pack("<II", ci.IMG_COMMON_MAGIC, 0x1234) + b"\x05\x00\x00\x00ab")
    with pytest.raises(RuntimeError_):
        ci.retarget(d, old_base=OLD, new_base=NEW, hostname="x")
