"""Attacks on the shared kernel from inside a real sandbox, as root: reading host facts, taking a mask away and
writing what it protected, and the system calls the seccomp profile (:mod:`sbx.runtime.seccomp`) refuses.

Every attack test here fails when run against main's configuration before this change (measured; the attacks
succeed there: identity uid map, no seccomp, no masks over ``/proc/cmdline`` and the block devices):
``/proc/cmdline`` shows the host's, ``backing_file`` lists every sandbox disk's host path, ``Seccomp:`` is 0 and
every probed call reaches the kernel. The syscall probe uses
arguments for which the kernel answers something other than EPERM when no filter is present (a result, EINVAL,
EFAULT, EBADF, ENOKEY or ENOSYS for what this kernel lacks), so EPERM can only come from the filter (and the
keyring calls, which the filter answers with ENOSYS, succeed or answer ENOKEY without it). ``acct``,
``swapon``/``swapoff`` and ``syslog`` are left out of the probe: the kernel already refuses them to a user
namespace's root by capability, so the filter is a second layer there (tests/unit/runtime/test_seccomp.py checks
they are listed). ``test_own_network_sysctls_stay_writable`` is no attack: it guards what must keep working.
``test_unmounted_mask_protects_nothing`` passes only with the shifted uid map (issue 17, item 1).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.e2e.conftest import Server
from tests.security.conftest import info, new_sandbox, root
from tests.slots import slotted

pytestmark = pytest.mark.e2e

# Runs inside the sandbox (python3 is in the image: sbx/guest/recipe.py). Prints one JSON object: each probe's
# result, "ok" or the errno's name. x86-64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl).
PROBE = r'''
import ctypes, errno, json, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
L = ctypes.c_long
keep = []

def s(b):
    buf = ctypes.create_string_buffer(b)
    keep.append(buf)
    return ctypes.addressof(buf)

def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(L(nr), *[L(a) for a in args])
    return "ok" if r >= 0 else errno.errorcode[ctypes.get_errno()]

def clone_newuser():
    # raw clone(CLONE_NEWUSER | SIGCHLD): a fork whose child exits at once
    ctypes.set_errno(0)
    pid = libc.syscall(L(56), L(0x10000000 | 17), L(0), L(0), L(0), L(0))
    if pid == 0:
        os._exit(0)
    if pid < 0:
        return errno.errorcode[ctypes.get_errno()]
    os.waitpid(pid, 0)
    return "ok"

def keyctl_int80():
    # the 32-bit ABI from a 64-bit process: int 0x80 with eax = 288 (i386 keyctl), KEYCTL_GET_KEYRING_ID of the
    # session keyring; returns eax (a key id or -errno). rbx is saved: the ABI wants it kept.
    code = bytes.fromhex("53" "b820010000" "bb00000000" "b9fdffffff" "31d2" "cd80" "5b" "c3")
    m = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    m.write(code)
    keep.append(m)
    fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
    r = fn()
    return "ok" if r >= 0 else errno.errorcode[-r]

bad_tv = (L * 2)(0, 2_000_000)
ts = (L * 2)(0, 0)
res = {
    "keyctl": call(250, 0, -3, 0),
    "add_key": call(248, s(b"user"), s(b"sbx"), s(b"x"), 1, -2),
    "request_key": call(249, s(b"user"), s(b"sbx-none"), 0, 0),
    "bpf": call(321, 0, 0, 0),
    "perf_event_open": call(298, 0, 0, -1, -1, 0),
    "userfaultfd": call(323, 1),
    "io_uring_setup": call(425, 1, 0),
    "io_uring_enter": call(426, -1, 0, 0, 0, 0, 0),
    "io_uring_register": call(427, -1, 0, 0, 0),
    "open_by_handle_at": call(304, -100, 0, 0),
    "kexec_load": call(246, 0, 0, 0, 0),
    "kexec_file_load": call(320, -1, -1, 0, 0, 0),
    "init_module": call(175, 0, 0, 0),
    "finit_module": call(313, -1, 0, 0),
    "delete_module": call(176, 0, 0),
    "iopl": call(172, 0),
    "ioperm": call(173, 0, 0, 0),
    "lookup_dcookie": call(212, 0, 0, 0),
    "settimeofday": call(164, ctypes.addressof(bad_tv), 0),
    "clock_settime": call(227, -100, ctypes.addressof(ts)),
    "unshare(CLONE_NEWUSER)": call(272, 0x10000000),
    "clone(CLONE_NEWUSER)": clone_newuser(),
    "clone3": call(435, 0, 0),
    "keyctl via int 0x80": keyctl_int80(),
    # still allowed: a new mount namespace, and a call newer than any the profile names (no -ENOSYS stub)
    "unshare(CLONE_NEWNS)": call(272, 0x00020000),
    "faccessat2": call(439, -100, s(b"/"), 0, 0),
}
print(json.dumps(res))
'''

EXPECTED = {
    **{name: "EPERM" for name in (
        "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
        "io_uring_enter", "io_uring_register", "open_by_handle_at", "kexec_load", "kexec_file_load", "init_module",
        "finit_module", "delete_module", "iopl", "ioperm", "lookup_dcookie", "settimeofday", "clock_settime",
        "unshare(CLONE_NEWUSER)", "clone(CLONE_NEWUSER)")},
    # the keyrings look absent (runc, run by Docker inside, accepts only that), also through the 32-bit ABI
    **{name: "ENOSYS" for name in ("keyctl", "add_key", "request_key", "keyctl via int 0x80")},
    "clone3": "ENOSYS",  # so glibc falls back to clone, whose flags the filter can read
    "unshare(CLONE_NEWNS)": "ok",
    "faccessat2": "ok",
}


def _probe(server: Server, sid: str) -> dict[str, str]:
    r = root(server, sid, f"python3 - <<'EOF'\n{PROBE}\nEOF")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def sandbox(sec_server: Server) -> str:
    """One sandbox for the tests that only look."""
    return new_sandbox(sec_server)


def test_host_facts_are_hidden(sec_server: Server, sandbox: str) -> None:
    """The host's kernel command line, its block devices and the loop devices' backing files (every sandbox's
    disk path on the node) show nothing inside."""
    r = root(sec_server, sandbox, """
        echo "cmdline=[$(cat /proc/cmdline)]"
        echo "partitions=[$(cat /proc/partitions)]"
        for d in /sys/block /sys/class/block /sys/dev/block /sys/devices/virtual/block; do
            echo "$d=[$(ls -A $d 2>&1)]"
        done
        echo "backing=[$(cat /sys/block/*/loop/backing_file /sys/devices/virtual/block/*/loop/backing_file \
                              /sys/class/block/*/loop/backing_file /sys/dev/block/*/loop/backing_file 2>/dev/null)]"
        echo "kmsg=[$(head -c 64 /proc/kmsg 2>&1)]"
        echo "debug=[$(ls -A /sys/kernel/debug 2>&1)]"
    """)
    assert r.returncode == 0, r.stderr
    lines = dict(ln.split("=", 1) for ln in r.stdout.splitlines() if "=" in ln)
    assert lines == {
        "cmdline": "[]", "partitions": "[]", "/sys/block": "[]", "/sys/class/block": "[]", "/sys/dev/block": "[]",
        "/sys/devices/virtual/block": "[]", "backing": "[]", "kmsg": "[]", "debug": "[]",
    }, r.stdout
    host_cmdline = Path("/proc/cmdline").read_text().strip()
    assert host_cmdline not in r.stdout


def test_seccomp_filter_applies_to_init_and_exec(sec_server: Server, sandbox: str) -> None:
    """systemd (PID 1, started by runc) and every ``sbx exec`` process run under the filter (mode 2)."""
    r = root(sec_server, sandbox, "grep '^Seccomp:' /proc/1/status /proc/self/status; systemctl is-system-running")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["/proc/1/status:Seccomp:", "2", "/proc/self/status:Seccomp:", "2", "running"]


def test_denied_syscalls_fail_with_eperm(sec_server: Server, sandbox: str) -> None:
    """Each call of the profile's deny list gets EPERM from root (the keyrings and clone3 ENOSYS), also through
    the 32-bit ABI;
    new mount namespaces and calls the profile does not name still work."""
    assert _probe(sec_server, sandbox) == EXPECTED


def test_new_user_namespaces_refused_other_namespaces_work(sec_server: Server, sandbox: str) -> None:
    """``unshare -U`` fails; mount, network, pid, ipc and uts namespaces (what Docker's runc needs) still work."""
    r = root(sec_server, sandbox, """
        unshare -U true 2>&1; echo "user=$?"
        unshare -Ur true 2>&1; echo "user-root=$?"
        unshare -m true && echo mount=0
        unshare -n true && echo net=0
        unshare -p -f true && echo pid=0
        unshare -i -u true && echo ipc-uts=0
    """)
    out = r.stdout
    assert "Operation not permitted" in out and "user=1" in out and "user-root=1" in out, out
    assert all(f"{ns}=0" in out for ns in ("mount", "net", "pid", "ipc-uts")), out + r.stderr


def test_own_network_sysctls_stay_writable(sec_server: Server, sandbox: str) -> None:
    """The sandbox's own ``net.*`` (its network namespace's) stay writable: Docker inside sets
    ``net.ipv4.ip_forward``. Not an attack: it guards the choice of leaving ``/proc/sys`` out of the read-only
    paths (runc 1.1 cannot carve ``net`` back out of a read-only ``/proc/sys``)."""
    r = root(sec_server, sandbox, """
        for f in /proc/sys/net/ipv4/ip_forward /proc/sys/net/core/somaxconn; do
            v=$(cat "$f") && printf '%s\\n' "$v" > "$f" && echo "wrote $f"
        done
    """)
    assert r.stdout.split() == ["wrote", "/proc/sys/net/ipv4/ip_forward", "wrote", "/proc/sys/net/core/somaxconn"], \
        r.stdout + r.stderr


def test_filter_survives_stop_and_resume(sec_server: Server) -> None:
    """A process from before a stop with memory comes back under the filter (CRIU restores it), and so does
    systemd; the probe still gets EPERM after the resume."""
    sid = new_sandbox(sec_server)
    r = root(sec_server, sid, """
        systemd-run --unit sbx-probe sleep infinity >/dev/null 2>&1 || exit 3
        for i in $(seq 100); do
            pid=$(systemctl show -p MainPID --value sbx-probe)
            [ "${pid:-0}" != 0 ] && echo "$pid" && exit 0
            sleep 0.2
        done
        exit 4
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    pid = r.stdout.split()[-1]
    sec_server.sbx("stop", sid, "--wait", check=True)
    sec_server.sbx("resume", sid, "--wait", check=True)
    assert info(sec_server, sid)["sandbox"]["memoryRestored"] is True
    r = root(sec_server, sid, f"grep -h '^Seccomp:' /proc/1/status /proc/{pid}/status; cat /proc/{pid}/comm")
    assert r.stdout.split() == ["Seccomp:", "2", "Seccomp:", "2", "sleep"], r.stdout + r.stderr
    assert _probe(sec_server, sid) == EXPECTED


def test_unmounted_mask_protects_nothing(sec_server: Server) -> None:
    """Root inside can take a runc mask away (``umount /proc/irq``) or mount a fresh procfs beside it: runc 1.1
    makes them inside the sandbox's own user namespace, so the kernel does not lock them. What they protected
    must still refuse writes: the host's IRQ affinities (written back with their current value) and its sysctls.
    Needs the shifted uid map (issue 17, item 1): under the identity map the writes reach the host."""
    sid = new_sandbox(sec_server)
    r = root(sec_server, sid, """
        umount /proc/irq && echo "unmounted /proc/irq"
        mkdir -p /mnt/proc2 && mount -t proc proc /mnt/proc2 && echo "mounted a fresh procfs"
        for f in /proc/irq/*/smp_affinity /mnt/proc2/irq/*/smp_affinity \
                 /proc/sys/kernel/core_pattern /proc/sys/vm/panic_on_oom; do
            [ -e "$f" ] || continue
            v=$(cat "$f") && (printf '%s\\n' "$v" > "$f") 2>/dev/null && echo "WROTE $f"
        done
        echo done
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "done"
    assert "WROTE" not in r.stdout, r.stdout


def test_sysfs_masks_hold_after_a_memory_resume_and_take_no_writes(sec_server: Server) -> None:
    """The masks over the host's block devices are read-only binds of the node's empty read-only tmpfs
    (``/run/sbx/<node>/masked``, :func:`sbx.runtime.oci.ensure_mask_dir`; a host mount, which CRIU only names, not a
    tmpfs of the sandbox's, which it would tar at every dump and restore): they still hide the loop devices after a
    stop and resume with memory, and root inside, remounting one read-write, can't write into it (the filesystem is
    read-only and host root's, unmapped inside), so nothing reaches the host or another sandbox."""
    sid = new_sandbox(sec_server)
    sec_server.sbx("stop", sid, "--wait", check=True)
    sec_server.sbx("resume", sid, "--wait", check=True)
    assert info(sec_server, sid)["sandbox"]["memoryRestored"] is True
    r = root(sec_server, sid, """
        echo "block=[$(ls -A /sys/block 2>&1)] class=[$(ls -A /sys/class/block 2>&1)]"
        echo "backing=[$(cat /sys/block/*/loop/backing_file 2>/dev/null)]"
        mount -o remount,bind,rw /sys/block 2>/dev/null && echo "remounted"
        (: > /sys/block/planted) 2>/dev/null && echo "WROTE /sys/block/planted"
        mkdir /sys/block/d 2>/dev/null && echo "WROTE /sys/block/d"
        chmod 0777 /sys/block 2>/dev/null && echo "CHMOD /sys/block"
        echo done
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "block=[] class=[]" in r.stdout and "backing=[]" in r.stdout, r.stdout
    assert "WROTE" not in r.stdout and "CHMOD" not in r.stdout, r.stdout
    assert r.stdout.strip().splitlines()[-1] == "done"
    node = slotted(os.environ.get("SBX_SEC_NODE", "sec"), "sbxsec0", "10.95.0.0/16")[0]
    masked = Path("/run/sbx") / node / "masked"
    assert os.path.ismount(masked) and list(masked.iterdir()) == []  # the node's read-only mask filesystem
    st = masked.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o555)
