"""LXCFS whose daemon died: the FUSE mount stays in the mount table but every read fails with ENOTCONN, and runc
can no longer bind-mount /proc/meminfo from it (a CI run on a host that had killed the previous session's
processes failed every boot this way). The node must detach such a mount and start a new daemon.

Runs a private LXCFS at a temp path with its own pidfile, so the host-wide one and running sandboxes are untouched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sbx.node.container import lxcfs

pytestmark = pytest.mark.e2e


def _kill(pidfile: Path) -> None:
    try:
        os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def test_a_mount_left_by_a_dead_lxcfs_is_replaced_by_a_live_one(tmp_path: Path) -> None:
    path = tmp_path / "lxcfs"
    pidfile = Path(f"{path}.pid")
    assert lxcfs.ensure_lxcfs(path) == path
    try:
        assert lxcfs.is_alive(path)
        first = int(pidfile.read_text().strip())
        _kill(pidfile)
        deadline = time.monotonic() + 10
        while lxcfs.is_alive(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lxcfs.is_mounted(path) and not lxcfs.is_alive(path), "a killed lxcfs should leave a dead mount"
        with pytest.raises(OSError) as err:
            (path / "proc" / "meminfo").read_bytes()
        assert err.value.errno == 107  # ENOTCONN: Transport endpoint is not connected

        assert lxcfs.ensure_lxcfs(path) == path
        assert lxcfs.is_alive(path)
        assert int(pidfile.read_text().strip()) != first
        assert b"MemTotal" in (path / "proc" / "meminfo").read_bytes()
    finally:
        _kill(pidfile)
        time.sleep(0.2)
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
