"""CRIU's kernel-feature cache (``/run/criu.kdat``) on a host whose ``/run`` is not a tmpfs.

Every CRIU run first probes what the kernel supports ("kerndat": memfd, userfaultfd, nftables, socket and
namespace features, hardware breakpoints...). CRIU keeps the result in ``/run/criu.kdat`` and loads it on later
runs, but it only writes that file when ``/run`` is a tmpfs, so that a reboot (a new kernel) clears it
(CRIU's ``criu/kerndat.c``). On these hosts ``/run`` lives on the root disk, so CRIU probed on every dump and
restore: 80-100 ms for ``criu check`` against 20-30 ms with the cache, 40-60 ms of each stop, resume, template
create and (twice) of each ``fork --memory`` (measured with ``python -m bench``; docs/architecture.md).

:func:`ensure` makes the cache CRIU would make on a tmpfs: it runs ``criu check`` in a private mount namespace
whose ``/run`` is an empty tmpfs, then moves the file it wrote to ``/run/criu.kdat``. CRIU reads the cache from
any filesystem (only its write checks for tmpfs). What a tmpfs would give for free is kept by a stamp beside it
(``/run/sbx/criu.kdat.stamp``: the boot id, the CRIU version and the file's SHA-256): after a reboot, a CRIU
upgrade or a changed file the cache is made again before the next CRIU run. An empty ``/run/criu.kdat.tmp``
is left in place on purpose: when a run learns something new CRIU tries to save again, finds the non-tmpfs, and
then deletes the cache itself; the existing file makes that save stop at its first step (``O_EXCL``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import threading
from pathlib import Path

from sbx.runtime.criu import criu_version

log = logging.getLogger("sbx.runtime")

RUN = Path("/run")
CACHE = RUN / "criu.kdat"
CACHE_TMP = RUN / "criu.kdat.tmp"
STAMP = RUN / "sbx" / "criu.kdat.stamp"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_guard = threading.Lock()


def run_is_tmpfs(mounts: str | None = None) -> bool:
    """Whether ``/run`` is a tmpfs (then CRIU keeps its cache itself), from ``mounts`` (``/proc/self/mounts``'s
    text; read when None): the type of the last mount at ``/run``, or of the nearest mount above it."""
    text = Path("/proc/self/mounts").read_text() if mounts is None else mounts
    best, fstype = "", ""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1]
        if (point == "/run" or point == "/") and len(point) >= len(best):
            best, fstype = point, parts[2]
    return fstype == "tmpfs"


def _stamp(criu: str, data: bytes) -> str:
    boot = _BOOT_ID.read_text().strip() if _BOOT_ID.exists() else "unknown"
    return f"boot={boot} criu={criu_version(criu)} sha256={hashlib.sha256(data).hexdigest()}\n"


def ensure(criu: str) -> str:
    """Make sure CRIU finds a current kernel-feature cache before it runs (module docstring). ``criu``: the
    CRIU wrapper's path. Returns what it found or did: ``"tmpfs"`` (``/run`` is a tmpfs: CRIU's own business),
    ``"kept"`` (the cache is current), ``"made"``, or ``"failed: <why>"`` (CRIU then probes as before: slower,
    never wrong). Never raises; thread-safe; several processes may call it at once (the file is replaced
    atomically)."""
    try:
        if run_is_tmpfs():
            return "tmpfs"
        with _guard:
            if CACHE.exists() and STAMP.exists() and STAMP.read_text() == _stamp(criu, CACHE.read_bytes()):
                CACHE_TMP.touch(mode=0o600, exist_ok=True)
                return "kept"
            return _make(criu)
    except OSError as e:
        return f"failed: {e}"


def _make(criu: str) -> str:
    """Probe in a private mount namespace with an empty tmpfs ``/run`` and install the cache it wrote."""
    script = 'mount -t tmpfs -o size=1m,mode=0755 sbx-kdat /run && "$0" check >/dev/null 2>&1; cat /run/criu.kdat'
    try:
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, criu],
                           capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"failed: {e}"
    data = p.stdout
    if p.returncode != 0 or not data:
        why = p.stderr.decode(errors="replace").strip()[-200:] or f"exit {p.returncode}"
        log.warning("CRIU kernel-feature cache not made: %s", why)
        return f"failed: {why}"
    part = RUN / f".criu.kdat.sbx.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(part, CACHE)  # an atomic rename within /run
    CACHE_TMP.touch(mode=0o600, exist_ok=True)
    STAMP.parent.mkdir(parents=True, exist_ok=True)
    stamp_part = STAMP.with_name(part.name.lstrip(".") + ".stamp")
    stamp_part.write_text(_stamp(criu, data))
    os.replace(stamp_part, STAMP)
    log.info("CRIU kernel-feature cache made at %s (/run is not a tmpfs)", CACHE)
    return "made"
