"""Issue 33: the escape attempts of ``tests/security`` against a gvisor sandbox, as root inside, and the ones only the
container class would fail: host kernel facts (``/proc``, ``/sys``, ``dmesg``, the kernel's symbols and modules),
which a gvisor sandbox never sees because its kernel is gVisor's. Whatever root does to its own ``/proc/sys`` and
cgroup files, it is gVisor's view: the host's sysctls and the sandbox's host cgroup limits stay as they were; the
host's loop devices and another sandbox's disk are out of reach; the network rules hold (``test_network``'s egress
test runs on both classes)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbx.runtime.runsc import RUNSC_PATH
from tests.e2e.conftest import Server
from tests.security.conftest import new_sandbox, root
from tests.security.test_escape import HOST_SYSCTLS, _host_cgroup, _raises

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gpair(sec_server: Server) -> Iterator[tuple[str, str]]:
    """A running gvisor sandbox and a container one beside it (deleted at the end of the module)."""
    assert RUNSC_PATH.is_file(), f"{RUNSC_PATH} is missing: run `sbx setup`"
    g, c = new_sandbox(sec_server, "--runtime", "gvisor"), new_sandbox(sec_server)
    yield g, c
    for sid in (g, c):
        sec_server.sbx("delete", sid, "--wait")


def _facts() -> dict[str, str]:
    """Host kernel facts a sandbox on the host's kernel could read: what each must not show inside."""
    return {"cmdline": Path("/proc/cmdline").read_text().strip(),
            "version": Path("/proc/version").read_text().strip(),
            "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip()}


def test_host_kernel_facts_are_not_there(sec_server: Server, gpair: tuple[str, str]) -> None:
    g = gpair[0]
    r = root(sec_server, g, """
        cat /proc/cmdline /proc/version /proc/sys/kernel/random/boot_id 2>&1
        echo "modules=[$(cat /proc/modules 2>/dev/null | head -n 3)]"
        echo "kallsyms=[$(head -n 3 /proc/kallsyms 2>/dev/null)]"
        echo "sysmodule=[$(ls -A /sys/module 2>/dev/null | head -n 3)]"
        echo "block=[$(ls -A /sys/block 2>/dev/null; ls -A /sys/class/block 2>/dev/null
                       cat /proc/partitions 2>/dev/null)]"
        echo "loops=[$(ls /dev | grep -E '^(loop|sd|vd|nvme|xvd)' || true)]"
        echo "dmesg=[$(dmesg 2>&1 | head -n 2)]"
        echo "kmsg=[$(timeout 2 head -c 64 /proc/kmsg 2>&1)]"
    """)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for name, fact in _facts().items():
        assert fact not in out, f"the host's {name} shows inside: {fact}"
    lines = dict(ln.split("=", 1) for ln in out.splitlines() if "=[" in ln)
    for key in ("modules", "kallsyms", "sysmodule", "block", "loops"):
        assert lines[key] == "[]", f"{key}: {lines[key]}"
    assert "gVisor" in lines["dmesg"], lines["dmesg"]  # its kernel's log, not the host's


def test_host_sysctls_stay_as_they_were(sec_server: Server, gpair: tuple[str, str]) -> None:
    before = {name: (Path("/proc/sys") / name).read_text() for name in HOST_SYSCTLS}
    for name in HOST_SYSCTLS:  # whatever gVisor answers to the write, it is gVisor's own /proc/sys
        root(sec_server, gpair[0], f"echo 1 > /proc/sys/{name}; sysctl -w kernel.{name.split('/')[-1]}=1")
    assert {name: (Path("/proc/sys") / name).read_text() for name in HOST_SYSCTLS} == before


def test_its_host_cgroup_limits_hold(sec_server: Server, gpair: tuple[str, str]) -> None:
    g = gpair[0]
    raises = _raises()
    files = {f: _host_cgroup(f.split("/")[0], g) / f.split("/")[1] for f in raises}
    present = {f: p for f, p in files.items() if p.exists()}
    assert "memory/memory.limit_in_bytes" in present and "pids/pids.max" in present, sorted(present)
    before = {f: p.read_text() for f, p in present.items()}
    script = "; ".join(
        f"echo {value} > /sys/fs/cgroup/{f} 2>/dev/null; mkdir -p /tmp/cg; "
        f"mount -t cgroup -o {f.split('/')[0]} cg /tmp/cg 2>/dev/null && echo {value} > /tmp/cg/{f.split('/')[1]} "
        "2>/dev/null; umount /tmp/cg 2>/dev/null"
        for f, value in raises.items()) + "; true"
    r = root(sec_server, g, script)
    assert r.returncode == 0, r.stderr
    assert {f: p.read_text() for f, p in present.items()} == before


def test_another_sandboxes_disk_and_the_hosts_devices_are_out_of_reach(sec_server: Server,
                                                                       gpair: tuple[str, str]) -> None:
    g = gpair[0]
    script = (
        "for i in $(seq 0 15); do mknod /tmp/l$i b 7 $i 2>/dev/null && head -c 1 /tmp/l$i >/dev/null 2>&1 "
        '&& echo "READ loop$i"; rm -f /tmp/l$i; done; '
        "for m in 8:0 253:0 259:0 1:1; do mknod /tmp/d b ${m%:*} ${m#*:} 2>/dev/null && head -c 1 /tmp/d >/dev/null "
        '2>&1 && echo "READ $m"; rm -f /tmp/d; done; '
        "mknod /tmp/mem c 1 1 2>/dev/null && head -c 1 /tmp/mem >/dev/null 2>&1 && echo READ-mem; rm -f /tmp/mem; "
        "ls /proc | grep -cE '^[0-9]+$'; true"
    )
    r = root(sec_server, g, script)
    assert r.returncode == 0, r.stderr
    assert "READ" not in r.stdout, r.stdout
    procs = int(r.stdout.strip().splitlines()[-1])
    host_procs = sum(1 for d in os.listdir("/proc") if d.isdigit())
    assert procs < 50 < host_procs, (procs, host_procs)  # its own few processes, none of the host's
