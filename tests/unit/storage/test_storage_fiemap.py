"""Range arithmetic and extent maps (FIEMAP)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from storage_helpers import MiB, write_random

from sbx.storage import fiemap
from sbx.storage.errors import StorageError


def test_merge_joins_touching_and_overlapping_ranges() -> None:
    assert fiemap.merge([(10, 20), (0, 5), (5, 8), (15, 30), (40, 40)]) == [(0, 8), (10, 30)]


def test_subtract() -> None:
    ranges = [(0, 100), (200, 300)]
    minus = [(10, 20), (90, 210), (250, 260), (400, 500)]
    assert fiemap.subtract(ranges, minus) == [(0, 10), (20, 90), (210, 250), (260, 300)]
    assert fiemap.subtract(ranges, []) == ranges
    assert fiemap.subtract(ranges, [(0, 1000)]) == []
    assert fiemap.total([(0, 10), (20, 25)]) == 15


def test_extents_of_a_sparse_file(work: Path) -> None:
    f = work / "sparse"
    with open(f, "wb") as fh:
        fh.truncate(64 * MiB)
    write_random(f, MiB, offset=0)
    write_random(f, 2 * MiB, offset=32 * MiB)
    ext = fiemap.extents(f)
    ranges = fiemap.merge((e.logical, e.end) for e in ext)
    assert ranges == [(0, MiB), (32 * MiB, 34 * MiB)]
    assert not any(e.shared for e in ext)
    os.truncate(f, 0)
    assert fiemap.extents(f) == []


def test_extents_of_missing_file(work: Path) -> None:
    with pytest.raises(StorageError) as e:
        fiemap.extents(work / "nope")
    assert e.value.code == "not_found"
