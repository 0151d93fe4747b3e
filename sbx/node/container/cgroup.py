"""Reading a sandbox's cgroup (v1) figures: memory limit and use, OOM kills, CPU time; freezing it for a dump.

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


def cpu_mark(cgroup_path: str) -> tuple[float, int]:
    """``(monotonic seconds, CPU nanoseconds)`` of the cgroup now: a ``previous`` for :func:`sample`, taken where
    a sandbox starts (a restore) so its first sample needs no window of its own."""
    return time.monotonic(), _read_int(CGROUP_ROOT / "cpuacct" / cgroup_path.lstrip("/") / "cpuacct.usage")


MIN_WINDOW = 0.001
"""Seconds a ``previous`` mark must be old before :func:`sample` measures CPU since it (cpuacct counts
nanoseconds, so a few milliseconds are a real if short measurement)."""


def sample(cgroup_path: str, window: float = 0.1, previous: tuple[float, int] | None = None,
           last_percent: float | None = None) -> CgroupSample:
    """Sample the cgroup now. CPU use is measured since ``previous`` (the ``cpu_mark`` of an earlier sample, or
    :func:`cpu_mark`: monotonic seconds, CPU nanoseconds) when it is given and at least :data:`MIN_WINDOW` and at
    most 60 s old. A ``previous`` younger than that with ``last_percent`` (what the sample that made it measured)
    gives that figure again and keeps ``previous`` as the mark: two views of one moment (a resume's ready event,
    then its answer) cost no wait. Otherwise CPU is measured over a ``window`` of seconds slept here. Missing
    cgroup files read as 0."""
    mem = CGROUP_ROOT / "memory" / cgroup_path.lstrip("/")
    cpu = CGROUP_ROOT / "cpuacct" / cgroup_path.lstrip("/") / "cpuacct.usage"
    now, usage = time.monotonic(), _read_int(cpu)
    age = now - previous[0] if previous is not None and usage >= previous[1] else None
    if previous is not None and age is not None and MIN_WINDOW <= age <= 60:
        mark = (now, usage)
        percent = _percent(previous, mark)
    elif previous is not None and age is not None and 0 <= age < MIN_WINDOW and last_percent is not None:
        mark, percent = previous, last_percent
    else:
        time.sleep(window)
        mark = (time.monotonic(), _read_int(cpu))
        percent = _percent((now, usage), mark)
    used = _read_int(mem / "memory.usage_in_bytes") - _kv(mem / "memory.stat").get("total_inactive_file", 0)
    return CgroupSample(
        memory_limit=_read_int(mem / "memory.limit_in_bytes"),
        memory_used=max(used, 0),
        oom_kills=oom_kills(cgroup_path),
        cpu_percent=percent,
        cpu_mark=mark,
    )


def _percent(t0: tuple[float, int], t1: tuple[float, int]) -> float:
    """Percent of one CPU used between two ``(monotonic seconds, CPU nanoseconds)`` marks."""
    return round(max(t1[1] - t0[1], 0) / 1e9 / (t1[0] - t0[0]) * 100, 1)


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


def _freezer_state(cgroup_path: str) -> Path:
    return CGROUP_ROOT / "freezer" / cgroup_path.lstrip("/") / "freezer.state"


def freeze(cgroup_path: str, timeout: float = 10.0) -> bool:
    """Freeze every task of the freezer cgroup at ``cgroup_path`` (what ``runc pause`` does) and wait until the
    kernel reports ``FROZEN``, polling every 0.5 ms at first, at most 10 ms later. Returns True once frozen; False
    when the cgroup does not exist or did not freeze within ``timeout`` seconds (it is thawed again then).

    Why not leave it to CRIU: CRIU freezes the cgroup itself but checks ``freezer.state`` in 100 ms steps, and
    right after the write the state is still ``FREEZING`` in most dumps here (its tasks have yet to be scheduled
    to reach the freezer), so a dump paid 100 ms for a freeze that takes about a millisecond. CRIU takes a cgroup
    it finds frozen as is. As ``runc pause`` does on cgroup v1 (the kernel's v1 freezer can stay ``FREEZING``
    while tasks fork), ``FROZEN`` is written again now and then while waiting."""
    f = _freezer_state(cgroup_path)
    try:
        f.write_text("FROZEN")
    except OSError:
        return False
    deadline = time.monotonic() + timeout
    delay, tries = 0.0005, 0
    while True:
        try:
            if f.read_text().strip() == "FROZEN":
                return True
        except OSError:
            return False
        if time.monotonic() > deadline:
            thaw(cgroup_path)
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
        tries += 1
        if tries % 20 == 0:
            try:
                f.write_text("FROZEN")
            except OSError:
                return False


def thaw(cgroup_path: str) -> None:
    """Thaw the freezer cgroup at ``cgroup_path`` (``runc resume``); a missing cgroup is ignored."""
    try:
        _freezer_state(cgroup_path).write_text("THAWED")
    except OSError:
        pass
