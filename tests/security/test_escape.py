"""Escape attempts as root inside real sandboxes (issue 17, items 1 and 3): the sandbox's root is an unprivileged
host uid of a range of its own, it can't write the host's sysctls, can't lift its own or the node's cgroup limits
(before or after a stop/resume with memory), and can't reach another sandbox's disk.

Against the identity map of before (sandbox root = host root) the sysctl write-backs, every limit raise, the
shifted-owner checks, the disjoint ranges and the node parent's limits all failed."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sbx.config import load_settings
from tests.e2e.conftest import Server
from tests.security.conftest import info, new_sandbox, root
from tests.slots import slotted

pytestmark = pytest.mark.e2e

CGROUP = Path("/sys/fs/cgroup")
HOST_SYSCTLS = ["kernel/core_pattern", "kernel/panic", "vm/panic_on_oom", "kernel/randomize_va_space",
                "fs/suid_dumpable"]


def _node() -> str:
    """The security server's node name (``sec_server``: SBX_SEC_NODE, moved to the run's test slot)."""
    return slotted(os.environ.get("SBX_SEC_NODE", "sec"), "sbxsec0", "10.95.0.0/16")[0]


def _record(sid: str) -> dict[str, Any]:
    """The node's record of ``sid`` (``<node_dir>/sandboxes/<id>/node.json``)."""
    path = load_settings(node_name=_node()).node_dir / "sandboxes" / sid / "node.json"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def _host_cgroup(ctrl: str, sid: str | None = None) -> Path:
    """The host's path of the sandbox's (or, without ``sid``, the node parent's) cgroup under ``ctrl``."""
    base = CGROUP / ctrl / "sbx" / _node()
    return base / sid if sid else base


def _uid_map(server: Server, sid: str) -> tuple[int, int, int]:
    r = root(server, sid, "cat /proc/self/uid_map")
    assert r.returncode == 0, r.stderr
    inside, outside, size = (int(x) for x in r.stdout.split())
    return inside, outside, size


@pytest.fixture(scope="module")
def pair(sec_server: Server) -> Iterator[tuple[str, str]]:
    """Two running sandboxes on the security server (deleted at the end of the module)."""
    a, b = new_sandbox(sec_server), new_sandbox(sec_server)
    yield a, b
    for sid in (a, b):
        sec_server.sbx("delete", sid, "--wait")


def test_host_sysctls_cannot_be_written_back(sec_server: Server, pair: tuple[str, str]) -> None:
    sid = pair[0]
    before = {name: (Path("/proc/sys") / name).read_text() for name in HOST_SYSCTLS}
    for name in HOST_SYSCTLS:
        r = root(sec_server, sid, f'v="$(cat /proc/sys/{name})" && printf "%s\\n" "$v" > /proc/sys/{name}')
        assert r.returncode != 0, f"root inside wrote the host's {name} back"
    assert {name: (Path("/proc/sys") / name).read_text() for name in HOST_SYSCTLS} == before


# What root inside tries to write over each of its own limits: more memory, no CFS quota, every host CPU, no pids
# limit, the OOM killer off.
def _raises() -> dict[str, str]:
    cpus = os.cpu_count() or 1
    return {
        "memory/memory.memsw.limit_in_bytes": str(8 << 30),
        "memory/memory.limit_in_bytes": str(8 << 30),
        "cpu/cpu.cfs_quota_us": "-1",
        "cpuset/cpuset.cpus": f"0-{cpus - 1}" if cpus > 1 else "0",
        "pids/pids.max": "max",
        "memory/memory.oom_control": "1",
    }


def _limits_hold(server: Server, sid: str) -> None:
    raises = _raises()
    before = {f: (_host_cgroup(f.split("/")[0], sid) / f.split("/")[1]).read_text() for f in raises}
    for f, value in raises.items():
        r = root(server, sid, f"echo {value} > /sys/fs/cgroup/{f}")
        assert r.returncode != 0, f"root inside wrote {value} to its own {f}"
        # a chmod/chown of the file first does not help either
        r = root(server, sid, f"chown root /sys/fs/cgroup/{f} || chmod 666 /sys/fs/cgroup/{f}; "
                              f"echo {value} > /sys/fs/cgroup/{f}")
        assert r.returncode != 0, f"root inside took over its own {f}"
    after = {f: (_host_cgroup(f.split("/")[0], sid) / f.split("/")[1]).read_text() for f in raises}
    assert after == before
    # systemd inside still manages its own groups (delegation): a transient unit runs
    r = root(server, sid, "systemd-run --wait --quiet true")
    assert r.returncode == 0, r.stderr


def test_own_limits_cannot_be_raised(sec_server: Server, pair: tuple[str, str]) -> None:
    _limits_hold(sec_server, pair[0])


def test_own_limits_hold_after_stop_and_resume_with_memory(sec_server: Server) -> None:
    sid = new_sandbox(sec_server)
    try:
        sec_server.sbx("stop", sid, "--wait", check=True)
        sec_server.sbx("resume", sid, "--wait", check=True)
        assert info(sec_server, sid)["sandbox"]["memoryRestored"] is True
        _limits_hold(sec_server, sid)
    finally:
        sec_server.sbx("delete", sid, "--wait")


def test_node_parent_is_capped_and_out_of_reach(sec_server: Server, pair: tuple[str, str]) -> None:
    mem = _host_cgroup("memory") / "memory.limit_in_bytes"
    pids = _host_cgroup("pids") / "pids.max"
    total = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines()
                     if ln.startswith("MemTotal:")).split()[1]) * 1024
    before = (mem.read_text(), pids.read_text())
    assert int(before[0]) < total, "the node's parent cgroup has no memory limit below the host's RAM"
    assert before[1].strip() != "max", "the node's parent cgroup has no pids limit"
    # Inside, the cgroup namespace makes the sandbox's own group the root: a fresh mount of the hierarchy shows
    # no parent, and no memory/pids limit file anywhere it can see is writable.
    script = (
        "mkdir -p /mnt/cgm /mnt/cgp; mount -t cgroup -o memory cgroup /mnt/cgm 2>/dev/null; "
        "mount -t cgroup -o pids cgroup /mnt/cgp 2>/dev/null; "
        "for f in /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max "
        "/mnt/cgm/memory.limit_in_bytes /mnt/cgm/../memory.limit_in_bytes /mnt/cgp/pids.max; do "
        '[ -e "$f" ] || continue; v=$(cat "$f"); echo "$v" > "$f" 2>/dev/null && echo "WROTE $f"; done; true'
    )
    r = root(sec_server, pair[0], script)
    assert r.returncode == 0, r.stderr
    assert "WROTE" not in r.stdout, r.stdout
    assert (mem.read_text(), pids.read_text()) == before


def test_root_inside_is_its_own_unprivileged_host_uid(sec_server: Server, pair: tuple[str, str]) -> None:
    sid = pair[0]
    inside, base, size = _uid_map(sec_server, sid)
    assert (inside, size) == (0, 65536)
    assert base >= 1_000_000 and _record(sid)["uidBase"] == base
    r = root(sec_server, sid, "rm -f /root/probe && echo x > /root/probe && stat -c %u /root/probe")
    assert r.stdout.strip() == "0", r.stderr
    bundle = Path("/run/sbx") / _node() / "bundles" / sid
    # the container's root on the host (what runc was given, an idmapped view): the file is the shifted uid
    assert (bundle / "rootfs" / "root" / "probe").stat().st_uid == base
    # the disk itself stays unshifted (no chown; the view does the mapping), seen through the host's plain mount
    assert (bundle / "disk" / "root" / "probe").stat().st_uid == 0
    # the sandbox's processes run as that host uid, not as host root
    state = subprocess.run(["runc", "--root", str(Path("/run/sbx") / _node() / "runc"), "state", sid],
                           capture_output=True, text=True, check=True)
    pid = json.loads(state.stdout)["pid"]
    uids = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("Uid:"))
    assert uids.split()[1:] == [str(base)] * 4


def test_two_sandboxes_have_disjoint_ranges(sec_server: Server, pair: tuple[str, str]) -> None:
    (_, a, n), (_, b, m) = _uid_map(sec_server, pair[0]), _uid_map(sec_server, pair[1])
    assert a + n <= b or b + m <= a, f"uid ranges overlap: {a}+{n} and {b}+{m}"
    assert 0 not in (a, b)


def _open_as(uid: int, path: Path) -> int:
    """Open ``path`` for reading (a folder: list it) in a child process running as host ``uid:uid``; 0 or the
    errno it failed with."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            if path.is_dir():
                os.listdir(path)
            else:
                os.close(os.open(path, os.O_RDONLY))
            os._exit(0)
        except OSError as e:
            os._exit(e.errno or 1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_cannot_read_another_sandboxes_disk(sec_server: Server, pair: tuple[str, str]) -> None:
    a, b = pair
    # Were A's root ever to reach the host's filesystem, it would be A's host uid there: B's disk image, seals,
    # memory folder, the plain mount of B's disk and the snapshots are closed to it.
    base_a = _uid_map(sec_server, a)[1]
    node_dir = load_settings(node_name=_node()).node_dir
    bundle_b = Path("/run/sbx") / _node() / "bundles" / b
    for path in (node_dir / "sandboxes" / b / "disk.ext4", node_dir / "sandboxes" / b, node_dir / "snapshots",
                 bundle_b / "disk" / "etc", bundle_b / "rootfs" / "etc"):
        assert path.exists(), path
        assert _open_as(base_a, path) == errno.EACCES, f"{path} is open to sandbox {a}'s host uid {base_a}"
    # From inside: every loop device the host has: make a node for it and read it, or open one under /dev.
    script = (
        "n=0; for d in /sys/block/loop*; do i=${d##*loop}; "
        'mknod /tmp/l$i b 7 $i 2>/dev/null && head -c 1 /tmp/l$i >/dev/null 2>&1 && echo "READ loop$i"; '
        'rm -f /tmp/l$i; done; for d in /dev/loop*; do [ -e "$d" ] && head -c 1 "$d" >/dev/null 2>&1 '
        '&& echo "READ $d"; done; true'
    )
    r = root(sec_server, a, script)
    assert r.returncode == 0, r.stderr
    assert "READ" not in r.stdout, r.stdout
