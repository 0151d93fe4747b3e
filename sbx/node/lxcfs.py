"""LXCFS on this node: per-container ``/proc/meminfo``, ``/proc/uptime``, ``/proc/cpuinfo``... so a sandbox
looks like a machine of its own size (``free`` shows its memory limit, ``uptime -s`` its own boot time).

LXCFS is one FUSE daemon per host (Debian package ``lxcfs``); the node starts it when it is not mounted yet and
leaves it running for every sandbox on the host. When it can't run, sandboxes boot without it (``free`` then
shows the host's memory) and :func:`ensure_lxcfs` returns None.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from sbx.storage import mounts

LXCFS_DIR = Path("/var/lib/lxcfs")
log = logging.getLogger("sbx.node")


def is_mounted(path: Path = LXCFS_DIR) -> bool:
    """True when an LXCFS (FUSE) filesystem is mounted at ``path``."""
    m = mounts.mount_at(path)
    return m is not None and "lxcfs" in (m.source + m.fstype)


def ensure_lxcfs(path: Path = LXCFS_DIR, wait: float = 5.0) -> Path | None:
    """Start LXCFS at ``path`` unless it already runs there; return ``path``, or None if LXCFS is not
    installed or did not come up within ``wait`` seconds."""
    if is_mounted(path):
        return path
    binary = shutil.which("lxcfs")
    if binary is None:
        log.warning("lxcfs is not installed: sandboxes will see the host's /proc/meminfo and uptime")
        return None
    path.mkdir(parents=True, exist_ok=True)
    subprocess.Popen([binary, str(path)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True, cwd="/",
                     env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if is_mounted(path) and (path / "proc" / "uptime").exists():
            return path
        time.sleep(0.05)
    log.warning("lxcfs did not come up at %s", path)
    return None
