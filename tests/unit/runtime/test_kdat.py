"""The CRIU kernel-feature cache on a host whose /run is not a tmpfs (sbx.runtime.kdat), with the real CRIU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sbx.runtime import kdat

CRIU = "/var/lib/sbx/criu/criu"
MOUNTS_DISK = "/dev/vda / ext4 rw 0 0\nproc /proc proc rw 0 0\n"
MOUNTS_TMPFS = "/dev/vda / ext4 rw 0 0\ntmpfs /run tmpfs rw 0 0\ntmpfs /run/lock tmpfs rw 0 0\n"


def test_run_is_tmpfs_reads_the_mount_at_or_above_run() -> None:
    assert kdat.run_is_tmpfs(MOUNTS_TMPFS)
    assert not kdat.run_is_tmpfs(MOUNTS_DISK)
    assert not kdat.run_is_tmpfs("tmpfs /run tmpfs rw 0 0\n/dev/x /run ext4 rw 0 0\n")  # the last one counts


@pytest.mark.skipif(kdat.run_is_tmpfs(), reason="/run is a tmpfs here: CRIU keeps its cache itself")
def test_criu_loads_the_cache_that_ensure_makes(tmp_path: Path) -> None:
    """Without the cache CRIU probes the kernel on every run; after ensure() it loads the file, and a stamp that
    no longer matches (another boot, another CRIU, a changed file) makes it again."""
    assert kdat.ensure(CRIU) in ("made", "kept")
    assert kdat.ensure(CRIU) == "kept"
    log = tmp_path / "check.log"
    subprocess.run([CRIU, "check", "-v4", "-o", str(log)], capture_output=True, timeout=60, check=True)
    assert "Loaded kdat cache from /run/criu.kdat" in log.read_text()
    assert kdat.CACHE_TMP.exists()  # stops CRIU's own failing save, which would delete the cache
    kdat.STAMP.write_text("boot=another criu=4.2.1 sha256=0\n")
    assert kdat.ensure(CRIU) == "made"
    assert kdat.ensure(CRIU) == "kept"


def test_a_criu_that_cannot_run_leaves_criu_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kdat, "run_is_tmpfs", lambda mounts=None: False)
    monkeypatch.setattr(kdat, "CACHE", tmp_path / "criu.kdat")
    monkeypatch.setattr(kdat, "STAMP", tmp_path / "sbx" / "stamp")
    out = kdat.ensure(str(tmp_path / "no-criu"))
    assert out.startswith("failed") and not (tmp_path / "criu.kdat").exists()
