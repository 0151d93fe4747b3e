"""LXCFS on this node: per-container ``/proc/meminfo``, ``/proc/uptime``, ``/proc/cpuinfo``... so a sandbox
looks like a machine of its own size (``free`` shows its memory limit, ``uptime -s`` its own boot time).

LXCFS is one FUSE daemon per host (Debian package ``lxcfs``); the node starts it when it is not mounted yet and
leaves it running for every sandbox on the host. When it can't run, sandboxes boot without it (``free`` then
shows the host's memory) and :func:`ensure_lxcfs` returns None.

A FUSE mount outlives its daemon: when ``lxcfs`` is killed (a host that kills every process of a session, an
OOM kill), ``/var/lib/lxcfs`` stays in the mount table but every access fails with ENOTCONN ("Transport
endpoint is not connected"), and runc cannot bind-mount from it. :func:`ensure_lxcfs` probes the mount, and
detaches a dead one (``umount -l``) before starting a new daemon; the node calls it before every boot and
restore.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from sbx.storage import mounts

LXCFS_DIR = Path("/var/lib/lxcfs")
log = logging.getLogger("sbx.node")
_start_lock = threading.Lock()  # two boots at once must not start two daemons


def is_mounted(path: Path = LXCFS_DIR) -> bool:
    """True when an LXCFS (FUSE) filesystem is mounted at ``path``."""
    m = mounts.mount_at(path)
    return m is not None and "lxcfs" in (m.source + m.fstype)


def is_alive(path: Path = LXCFS_DIR) -> bool:
    """True when the LXCFS daemon behind ``path`` answers: its ``proc/uptime`` can be read. A mount whose
    daemon died raises ENOTCONN here."""
    try:
        with open(path / "proc" / "uptime", "rb") as f:
            f.read(64)
        return True
    except OSError:
        return False


def ensure_lxcfs(path: Path = LXCFS_DIR, wait: float = 5.0) -> Path | None:
    """Start LXCFS at ``path`` unless a live one already runs there; return ``path``, or None if LXCFS is not
    installed or did not come up within ``wait`` seconds. A mount left by a dead daemon is detached first
    (``umount -l``: sandboxes still holding it keep their view until they restart)."""
    with _start_lock:
        return _ensure(path, wait)


def _ensure(path: Path, wait: float) -> Path | None:
    if is_mounted(path):
        if is_alive(path):
            return path
        log.warning("lxcfs at %s does not answer (its daemon died): detaching it and starting a new one", path)
        subprocess.run(["umount", "-l", str(path)], stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        if is_mounted(path):
            log.warning("could not detach the dead lxcfs mount at %s", path)
            return None
    binary = shutil.which("lxcfs")
    if binary is None:
        log.warning("lxcfs is not installed: sandboxes will see the host's /proc/meminfo and uptime")
        return None
    path.mkdir(parents=True, exist_ok=True)
    # lxcfs refuses to start while another daemon holds its pidfile: only the host-wide mount uses the default
    pidfile = "/run/lxcfs.pid" if path == LXCFS_DIR else f"{path}.pid"
    subprocess.Popen([binary, "--pidfile", pidfile, str(path)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True, cwd="/",
                     env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if is_mounted(path) and is_alive(path):
            return path
        time.sleep(0.05)
    log.warning("lxcfs did not come up at %s", path)
    return None
