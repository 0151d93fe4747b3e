"""Cgroup delegation (:mod:`sbx.node.container.cgdelegate`) on a fake cgroup v1 tree, uid ranges taken by node records,
and the mount targets precreated for runc's restore."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sbx.node.container import cgdelegate, guestfs
from sbx.node.container.rootfs import taken_uid_bases
from sbx.runtime.oci import ContainerSpec, build_config, mount_targets
from sbx.storage import idmap

LIMITS = {
    "memory": ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.oom_control"],
    "cpu": ["cpu.cfs_quota_us", "cpu.cfs_period_us"],
    "cpuset": ["cpuset.cpus", "cpuset.mems"],
    "pids": ["pids.max"],
    "blkio": ["blkio.throttle.read_bps_device"],
    "devices": ["devices.allow", "devices.deny"],
}
MEMBERSHIP = ["cgroup.procs", "tasks", "cgroup.clone_children", "notify_on_release"]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A fake /sys/fs/cgroup: each controller has /sbx/n/sb_x with its limit and membership files, a child group
    ``system.slice/ssh.service`` and the node parent; ``cpuacct`` is a symlink to ``cpu`` as on some hosts."""
    root = tmp_path / "cgroup"
    for ctrl, limits in LIMITS.items():
        top = root / ctrl / "sbx" / "n" / "sb_x"
        child = top / "system.slice" / "ssh.service"
        child.mkdir(parents=True)
        for d in (top, top / "system.slice", child, top.parent):
            for name in limits + MEMBERSHIP:
                (d / name).write_text("1\n")
    (root / "cpuacct").symlink_to(root / "cpu")
    return root


def test_delegate_gives_membership_and_below_but_not_own_limits(tree: Path) -> None:
    base = idmap.uid_base(5)
    assert cgdelegate.delegate("/sbx/n/sb_x", base, base, root=tree) > 0
    for ctrl, limits in LIMITS.items():
        top = tree / ctrl / "sbx" / "n" / "sb_x"
        assert top.stat().st_uid == base
        for name in MEMBERSHIP:
            assert (top / name).stat().st_uid == base, (ctrl, name)
        for name in limits:  # the container's own limits stay host root's
            assert (top / name).stat().st_uid == 0, (ctrl, name)
        for p in [top / "system.slice", *(top / "system.slice").rglob("*")]:
            assert (p.stat().st_uid, p.stat().st_gid) == (base, base), p
        for p in top.parent.iterdir():  # the node parent is untouched
            if p != top:
                assert p.stat().st_uid == 0, p
        assert top.parent.stat().st_uid == 0


def test_delegate_skips_missing_hierarchies(tree: Path) -> None:
    assert cgdelegate.delegate("/sbx/n/sb_absent", 1_000_000, 1_000_000, root=tree) == 0
    assert len(cgdelegate.hierarchies(tree)) == len(LIMITS)  # the cpuacct symlink collapses onto cpu


def test_node_limits(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
        (root / "memory" / "sbx" / "n").mkdir(parents=True, exist_ok=True)
        (root / "memory" / "sbx" / "n" / name).write_text(str(2**63 - 1))
    (root / "pids").mkdir()
    written = cgdelegate.set_node_limits("n", 1024, root=root)
    total = cgdelegate.node_memory_limit(0)
    assert written["memory"] == total - (1024 << 20) or written["memory"] == 256 << 20
    assert int((root / "memory/sbx/n/memory.limit_in_bytes").read_text()) == written["memory"]
    assert int((root / "memory/sbx/n/memory.memsw.limit_in_bytes").read_text()) == written["memory"]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    assert int((root / "pids/sbx/n/pids.max").read_text()) == pid_max - cgdelegate.PIDS_RESERVE == written["pids"]


def test_taken_uid_bases_spans_every_node(tmp_path: Path) -> None:
    def record(node: str, sid: str, doc: object) -> None:
        d = tmp_path / "nodes" / node / "sandboxes" / sid
        d.mkdir(parents=True)
        (d / "node.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))

    record("a", "sb_1", {"uidBase": idmap.uid_base(0)})
    record("b", "sb_2", {"uidBase": idmap.uid_base(2)})
    record("b", "sb_old", {"phase": "stopped"})  # made before shifted maps: identity
    record("b", "sb_bad", "{not json")
    taken = taken_uid_bases(tmp_path)
    assert taken == {idmap.uid_base(0), idmap.uid_base(2), 0}
    assert idmap.lowest_free_base(taken) == idmap.uid_base(1)


def test_mount_targets_for_restore(tmp_path: Path) -> None:
    lx = tmp_path / "lxcfs"
    (lx / "proc").mkdir(parents=True)
    for name in ("cpuinfo", "meminfo"):
        (lx / "proc" / name).write_text("")
    spec = ContainerSpec(hostname="h", memory_bytes=1 << 28, vcpus=1, cpuset_cpus="0", cgroup_path="/sbx/n/s",
                         lxcfs_dir=str(lx), uid_base=idmap.uid_base(1))
    config = build_config(spec)
    assert config["linux"]["uidMappings"] == [{"containerID": 0, "hostID": idmap.uid_base(1), "size": 65536}]
    assert config["linux"]["gidMappings"] == config["linux"]["uidMappings"]
    targets = dict(mount_targets(config))
    assert targets["/proc/cpuinfo"] is True and targets["/proc/meminfo"] is True
    assert targets["/dev"] is False and targets["/sys"] is False and targets["/tmp"] is False
    # below a tmpfs or sysfs of the config: CRIU or the kernel makes those, runc doesn't
    assert "/dev/pts" not in targets and "/sys/fs/cgroup" not in targets and "/run/lock" not in targets


def test_ensure_path_makes_targets_without_following_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    guestfs.ensure_path(root, "/proc/cpuinfo", is_file=True)
    guestfs.ensure_path(root, "/sys/fs", is_file=False)
    assert (root / "proc/cpuinfo").is_file() and (root / "sys/fs").is_dir()
    (root / "proc/cpuinfo").write_text("kept")
    guestfs.ensure_path(root, "/proc/cpuinfo", is_file=True)
    assert (root / "proc/cpuinfo").read_text() == "kept"
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "evil").symlink_to(outside)
    with pytest.raises(guestfs.UnsafePath):
        guestfs.ensure_path(root, "/evil/x", is_file=True)
    assert not (outside / "x").exists()
