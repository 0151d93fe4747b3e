"""Host kernel limits sized for many sandboxes on one node, set by ``sbx setup`` and checked by ``sbx doctor``.

Measured (issue 16): with ``fs.inotify.max_user_instances`` at its default 128, the 23rd idle small sandbox failed
to boot (its systemd logs "Failed to create inotify object") and CRIU dumps failed near that count ("Can't create
inotify: Too many open files"); with the limit raised, 100 of 100 ran. Each sandbox's systemd and services also
take inotify watches, pids and (through its veth) conntrack entries, so those go up too.

:data:`WANTED` are the floors; a host already above one keeps its value. ``sbx setup`` writes them to
:data:`SYSCTL_FILE` (so they survive a reboot) and applies them now; a key that can't be written (read-only
``/proc/sys`` in a container, or a missing one such as ``nf_conntrack_max`` without conntrack) is reported, not
fatal.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SYSCTL_FILE = Path("/etc/sysctl.d/60-sbx.conf")

WANTED: dict[str, int] = {
    "fs.inotify.max_user_instances": 8192,
    "fs.inotify.max_user_watches": 1048576,
    "kernel.pid_max": 4194304,
    "net.netfilter.nf_conntrack_max": 262144,
}
"""sysctl key -> the lowest value sbx wants (room for ~300 idle small sandboxes per node, the bench's goal)."""

OPTIONAL = frozenset({"net.netfilter.nf_conntrack_max"})
"""Keys a host may lack (no conntrack loaded yet): absent is fine."""


@dataclass
class Limit:
    """One limit: ``key``, the ``current`` value (None when the key does not exist), the ``wanted`` floor,
    ``ok`` (current >= wanted, or an optional key that is absent) and, after :func:`apply`, ``error`` when it
    could not be raised."""

    key: str
    current: int | None
    wanted: int
    ok: bool
    error: str = ""


def _path(key: str, proc_sys: Path) -> Path:
    return proc_sys / key.replace(".", "/")


def read(proc_sys: Path = Path("/proc/sys")) -> list[Limit]:
    """The current value of every :data:`WANTED` key under ``proc_sys`` and whether it is high enough."""
    out = []
    for key, want in WANTED.items():
        try:
            cur: int | None = int(_path(key, proc_sys).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            cur = None
        ok = (cur is None and key in OPTIONAL) or (cur is not None and cur >= want)
        out.append(Limit(key, cur, want, ok))
    return out


def apply(sysctl_file: Path = SYSCTL_FILE, proc_sys: Path = Path("/proc/sys")) -> list[Limit]:
    """Write :data:`sysctl_file` with ``key = max(current, wanted)`` for every key that exists, then raise each
    value below its floor now (writing ``proc_sys``). Returns the limits as found afterwards, ``error`` set for
    each one that could not be raised. Raises ``OSError`` only when ``sysctl_file`` can't be written."""
    before = read(proc_sys)
    lines = ["# Written by `sbx setup`: kernel limits for many sandboxes on one node (see sbx.node.host.limits).\n"]
    for lim in before:
        if lim.current is not None:
            lines.append(f"{lim.key} = {max(lim.current, lim.wanted)}\n")
    sysctl_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = sysctl_file.with_suffix(".tmp")
    tmp.write_text("".join(lines))
    tmp.replace(sysctl_file)
    errors: dict[str, str] = {}
    for lim in before:
        if lim.current is None or lim.current >= lim.wanted:
            continue
        try:
            _path(lim.key, proc_sys).write_text(f"{lim.wanted}\n")
        except OSError as e:
            errors[lim.key] = f"could not set it ({e.strerror or e}); a container's /proc/sys may be read-only"
    after = read(proc_sys)
    for lim in after:
        lim.error = errors.get(lim.key, "")
    return after
