"""Handing a sandbox its cgroups (v1) the way systemd's ``Delegate=`` does, and the node's aggregate limits.

With a shifted uid map the sandbox's root is host uid ``base``, and runc 1.1.5 leaves the container's cgroup
directories owned by host root: systemd inside can't create ``init.scope`` and exits 255 (runtime-facts, "Shifted
uid map with CRIU"). :func:`delegate` gives the shifted root, under every hierarchy:

- the container's own directory and its membership files (:data:`DELEGATED_FILES`): it may make child groups and
  move its own processes between them;
- everything below it, recursively (the groups systemd makes, and the ones CRIU re-creates root-owned on restore,
  such as ``system.slice``);

but never the limit files of its own directory (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``,
``cpu.cfs_quota_us``, ``cpuset.cpus``, ``pids.max``, ``memory.oom_control``, ``blkio.*``, ``devices.*``,
``freezer.state``): they stay host root's, which is unmapped inside, so root inside gets EACCES writing them. The
v1 controllers are hierarchical here (memory ``use_hierarchy`` is always 1; cpuset, pids, devices and CFS quota
bound children by their parent), so limits a child group sets can't lift the container's.

:func:`set_node_limits` caps the node's parent group ``/sbx/<node>`` (memory and pids) so every sandbox together
can't take the host's last memory or PIDs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("sbx.node")

CGROUP_ROOT = Path("/sys/fs/cgroup")

#: Files of the container's own cgroup directory the sandbox's root may write (membership, not limits). The
#: cgroup v2 ones matter only for the ``unified`` hierarchy.
DELEGATED_FILES = ("cgroup.procs", "tasks", "cgroup.clone_children", "notify_on_release",
                   "cgroup.subtree_control", "cgroup.threads")

#: PIDs kept back from every sandbox together (for the host's own processes).
PIDS_RESERVE = 4096


def hierarchies(root: Path = CGROUP_ROOT) -> list[Path]:
    """The mounted cgroup hierarchies under ``root`` (``/sys/fs/cgroup/memory``, ...), one path per real
    directory (``cpu,cpuacct`` symlinks collapse)."""
    seen: dict[str, Path] = {}
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    for p in entries:
        real = os.path.realpath(p)
        if os.path.isdir(real) and real not in seen:
            seen[real] = Path(real)
    return list(seen.values())


def _chown(path: str, uid: int, gid: int) -> None:
    try:
        os.chown(path, uid, gid, follow_symlinks=False)
    except FileNotFoundError:
        pass


def delegate(cgroup_path: str, uid: int, gid: int, root: Path = CGROUP_ROOT) -> int:
    """Give ``uid:gid`` (the sandbox's shifted root) the container's cgroup ``cgroup_path`` (``/sbx/n/sb_x``)
    under every hierarchy in ``root``: the directory, its :data:`DELEGATED_FILES` and everything below it; the
    directory's own limit files stay as they are. Hierarchies without the directory are skipped. Returns how many
    paths were chowned. Raises ``OSError`` when a chown fails for another reason than the file vanishing."""
    count = 0
    rel = cgroup_path.strip("/")
    for h in hierarchies(root):
        top = h / rel
        if not top.is_dir():
            continue
        _chown(str(top), uid, gid)
        count += 1
        for name in DELEGATED_FILES:
            if (top / name).exists():
                _chown(str(top / name), uid, gid)
                count += 1
        for dirpath, dirnames, filenames in os.walk(top):
            if dirpath == str(top):
                for d in dirnames:
                    _chown(os.path.join(dirpath, d), uid, gid)
                    count += 1
                continue
            for name in dirnames + filenames:
                _chown(os.path.join(dirpath, name), uid, gid)
                count += 1
    return count


def node_memory_limit(reserve_mib: int) -> int:
    """Bytes every sandbox of a node may use together: the host's RAM (``MemTotal``) minus ``reserve_mib``, at
    least 256 MiB."""
    total_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            total_kib = int(line.split()[1])
    return max(total_kib * 1024 - reserve_mib * 1024 * 1024, 256 << 20)


def node_pids_limit() -> int:
    """Tasks every sandbox of a node may run together: ``kernel.pid_max`` minus :data:`PIDS_RESERVE`."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return max(pid_max - PIDS_RESERVE, 1024)


def set_node_limits(node_name: str, reserve_mib: int, root: Path = CGROUP_ROOT) -> dict[str, int]:
    """Create the node's parent cgroup ``/sbx/<node_name>`` under the memory and pids hierarchies and cap it:
    ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` when swap is accounted) at
    :func:`node_memory_limit`, ``pids.max`` at :func:`node_pids_limit`. Returns the figures written
    (``{"memory": bytes, "pids": n}``); a limit the kernel refuses (sandboxes already use more) is logged and
    left as it was."""
    mem, pids = node_memory_limit(reserve_mib), node_pids_limit()
    written: dict[str, int] = {}
    mdir = root / "memory" / "sbx" / node_name
    pdir = root / "pids" / "sbx" / node_name
    if (root / "memory").is_dir():
        mdir.mkdir(parents=True, exist_ok=True)
        # memsw must stay >= memory: raise memsw first when growing, lower memory first when shrinking.
        files = ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"]
        try:
            current = int((mdir / "memory.limit_in_bytes").read_text())
        except (OSError, ValueError):
            current = 0
        if mem < current:
            files.reverse()
        for name in files:
            if (mdir / name).exists():
                try:
                    (mdir / name).write_text(str(mem))
                    written["memory"] = mem
                except OSError as e:
                    log.warning("node memory limit %s=%d refused: %s", name, mem, e)
    if (root / "pids").is_dir():
        pdir.mkdir(parents=True, exist_ok=True)
        try:
            (pdir / "pids.max").write_text(str(pids))
            written["pids"] = pids
        except OSError as e:
            log.warning("node pids limit %d refused: %s", pids, e)
    return written
