"""Reading a sandbox's cgroup (v1) figures: memory limit and use, OOM kills, CPU time.

This host runs cgroup v1 controllers under ``/sys/fs/cgroup/<controller>`` (runtime-facts), and runc puts a
container at ``<controller>/<cgroupsPath>``. File meanings follow the kernel's cgroup-v1 memory and cpuacct docs:
``memory.usage_in_bytes``, ``memory.limit_in_bytes``, ``memory.stat`` (``total_inactive_file``),
``memory.oom_control`` (``oom_kill`` counts kills in this cgroup and below), ``cpuacct.usage`` (nanoseconds).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass
class CgroupSample:
    """``memory_limit`` and ``memory_used`` in bytes (used excludes inactive page cache, like ``free``'s
    "used"), ``oom_kills`` (count), ``cpu_percent`` (percent of one CPU over the sampling window)."""

    memory_limit: int
    memory_used: int
    oom_kills: int
    cpu_percent: float
    cpu_mark: tuple[float, int] = (0.0, 0)


def _read_int(p: Path, default: int = 0) -> int:
    try:
        return int(p.read_text().strip())
    except (OSError, ValueError):
        return default


def _kv(p: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in p.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().lstrip("-").isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def oom_kills(cgroup_path: str) -> int:
    """OOM kills the memory cgroup at ``cgroup_path`` (e.g. ``/sbx/node0/sb_x``) has counted."""
    return _kv(CGROUP_ROOT / "memory" / cgroup_path.lstrip("/") / "memory.oom_control").get("oom_kill", 0)


def sample(cgroup_path: str, window: float = 0.1, previous: tuple[float, int] | None = None) -> CgroupSample:
    """Sample the cgroup now. CPU use is measured since ``previous`` (the ``cpu_mark`` of an earlier sample:
    monotonic seconds, CPU nanoseconds) when it is given and at least 0.05 s old and at most 60 s, else over a
    ``window`` of seconds slept here. Missing cgroup files read as 0."""
    mem = CGROUP_ROOT / "memory" / cgroup_path.lstrip("/")
    cpu = CGROUP_ROOT / "cpuacct" / cgroup_path.lstrip("/") / "cpuacct.usage"
    now, usage = time.monotonic(), _read_int(cpu)
    if previous is not None and 0.05 <= now - previous[0] <= 60 and usage >= previous[1]:
        t0, u0, t1, u1 = previous[0], previous[1], now, usage
    else:
        t0, u0 = now, usage
        time.sleep(window)
        t1, u1 = time.monotonic(), _read_int(cpu)
    used = _read_int(mem / "memory.usage_in_bytes") - _kv(mem / "memory.stat").get("total_inactive_file", 0)
    return CgroupSample(
        memory_limit=_read_int(mem / "memory.limit_in_bytes"),
        memory_used=max(used, 0),
        oom_kills=oom_kills(cgroup_path),
        cpu_percent=round(max(u1 - u0, 0) / 1e9 / (t1 - t0) * 100, 1),
        cpu_mark=(t1, u1),
    )


def has_processes(cgroup_path: str) -> bool:
    """True while any task is left in the memory cgroup at ``cgroup_path`` or below."""
    base = CGROUP_ROOT / "memory" / cgroup_path.lstrip("/")
    if not base.is_dir():
        return False
    for procs in base.rglob("cgroup.procs"):
        try:
            if procs.read_text().strip():
                return True
        except OSError:
            continue
    return False


def kill_all(cgroup_path: str) -> int:
    """SIGKILL every task in the memory cgroup at ``cgroup_path`` and below (what a failed restore or a crashed
    container leaves behind). Returns how many were signalled."""
    base = CGROUP_ROOT / "memory" / cgroup_path.lstrip("/")
    count = 0
    if not base.is_dir():
        return 0
    for procs in base.rglob("cgroup.procs"):
        try:
            pids = [int(x) for x in procs.read_text().split()]
        except (OSError, ValueError):
            continue
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                count += 1
            except OSError:
                pass
    return count


def remove_tree(cgroup_path: str) -> None:
    """Remove the cgroup directories of ``cgroup_path`` under every controller, deepest first (a leftover of a
    crashed or killed container). Directories that still hold processes stay."""
    for ctrl in CGROUP_ROOT.iterdir():
        base = ctrl / cgroup_path.lstrip("/")
        if not base.is_dir():
            continue
        for d in sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
        try:
            base.rmdir()
        except OSError:
            pass
