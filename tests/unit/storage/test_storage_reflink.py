"""Reflink clones share blocks: no extra space, same bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from storage_helpers import MiB, sha256, used_bytes, write_random

from sbx.storage import reflink, space
from sbx.storage.errors import StorageError


def test_clone_uses_no_extra_space(work: Path) -> None:
    a = work / "a.img"
    write_random(a, 64 * MiB)
    before = used_bytes(work)
    b = reflink.clone(a, work / "b.img")
    after = used_bytes(work)
    assert after - before < MiB  # only metadata (refcount btree, inode), not 64 MiB of data
    assert sha256(a) == sha256(b)
    assert os.stat(b).st_mode & 0o777 == 0o644
    assert space.unique_bytes(b, [a]) == 0
    assert space.shared_bytes(b) == 64 * MiB


def test_clone_refuses_existing_destination_and_missing_source(work: Path) -> None:
    a, b = work / "a", work / "b"
    a.write_bytes(b"a" * 4096)
    b.write_bytes(b"keep")
    with pytest.raises(StorageError) as e:
        reflink.clone(a, b)
    assert e.value.code == "exists"
    assert b.read_bytes() == b"keep"
    with pytest.raises(StorageError) as e:
        reflink.clone(work / "missing", work / "c")
    assert e.value.code == "not_found"
    assert not (work / "c").exists()


def test_volume_supports_reflink(work: Path) -> None:
    assert reflink.supports_reflink(work)
    assert list(work.iterdir()) == []  # the probe cleans up
