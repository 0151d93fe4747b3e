"""The default seccomp profile of a sandbox (the OCI ``linux.seccomp`` section).

A sandbox's root holds ``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN`` in its own user namespace, and the kernel is the
host's: every system call is attack surface shared with the host and every other sandbox. The profile follows the
spirit of Docker's default profile (moby ``profiles/seccomp/default.json``) in a simpler form: allow by default and
deny a list of calls with ``EPERM`` (``ENOSYS`` for a few). The list holds what a machine-like sandbox does not
need and what has a history of kernel bugs or host-wide effects:

- kernel keyrings (``keyctl``, ``add_key``, ``request_key``): not namespaced. These get ``ENOSYS`` ("kernel
  without keyrings", as LXD's profile does) rather than ``EPERM``: runc, run by Docker inside a sandbox, joins a
  session keyring for each container and fails the start on any error but ``ENOSYS`` (measured: "unable to join
  session keyring: operation not permitted"); systemd skips keyrings on either;
- ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*``: large, often-exploited kernel surfaces;
- ``kexec_*``, module loading, ``acct``, ``swapon``/``swapoff``, ``iopl``/``ioperm``, ``lookup_dcookie``: host-wide
  effects;
- ``open_by_handle_at``: opens any inode of a mounted filesystem by handle, past the mount's root (the
  "shocker" escape);
- ``settimeofday``/``clock_settime``: the clock is the host's (``adjtimex`` stays: with ``modes=0`` it only reads,
  and systemd/timedatectl use it that way);
- ``syslog``: the host's kernel ring buffer (``dmesg``);
- new user namespaces: ``unshare`` and ``clone`` with ``CLONE_NEWUSER`` get ``EPERM`` (matched on the flag bit with
  ``SCMP_CMP_MASKED_EQ``), and ``clone3`` gets ``ENOSYS``: its flags sit behind a pointer that seccomp cannot read,
  and glibc falls back to ``clone`` on ``ENOSYS`` (Docker does the same). Other namespaces (mount, pid, net, ipc,
  uts, cgroup) stay allowed: Docker inside a sandbox runs runc, which needs them.

Left allowed on purpose: ``reboot`` (systemd as PID 1 halts its container with it; in a pid namespace it only
ends that namespace), ``seccomp``/``prctl`` (systemd sandboxes its own services), ``mount``/``pivot_root``/``setns``
(nested containers), ``ptrace`` (debuggers).

CRIU dumps each task's filter and installs it again at the end of a restore, so a resumed sandbox keeps it; runc
applies the same profile to every ``runc exec`` process. Field names are the OCI runtime spec's
(``config-linux.md``, "Seccomp"); runc 1.1 skips names its libseccomp does not know, and does not add its
``-ENOSYS`` stub when the default action is allow, so newer syscalls keep working.
"""

from __future__ import annotations

from typing import Any

EPERM = 1
ENOSYS = 38

#: ``CLONE_NEWUSER`` from ``<linux/sched.h>``: the flag bit of ``clone(2)``/``unshare(2)`` that asks for a new
#: user namespace.
CLONE_NEWUSER = 0x10000000

#: x86-64 with the 32-bit (``int 0x80``) and x32 ABIs, as Docker's profile lists them, so a 32-bit binary meets
#: the same rules (libseccomp translates every rule to each ABI's numbers; a call from any other ABI gets the
#: filter's bad-architecture action and is killed).
ARCHITECTURES = ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]

#: Calls that get ``ENOSYS`` whatever their arguments: the keyrings (see the module docstring for why not EPERM).
NOT_IMPLEMENTED = ["keyctl", "add_key", "request_key"]

#: Calls refused with ``EPERM`` whatever their arguments, by group (see the module docstring for why).
DENIED: dict[str, list[str]] = {
    "kernel attack surface": ["bpf", "perf_event_open", "userfaultfd",
                              "io_uring_setup", "io_uring_enter", "io_uring_register"],
    "host-wide effects": ["kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
                          "acct", "swapon", "swapoff", "iopl", "ioperm", "lookup_dcookie"],
    "file handles": ["open_by_handle_at"],
    "host clock": ["settimeofday", "clock_settime"],
    "host kernel log": ["syslog"],
}


def _masked(name: str, index: int, bits: int) -> dict[str, Any]:
    """A rule refusing ``name`` with EPERM when argument ``index`` has all of ``bits`` set
    (``(arg & bits) == bits``: libseccomp's ``SCMP_CMP_MASKED_EQ`` takes the mask as ``value`` and the expected
    result as ``valueTwo``)."""
    return {"names": [name], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
            "args": [{"index": index, "value": bits, "valueTwo": bits, "op": "SCMP_CMP_MASKED_EQ"}]}


def default_profile() -> dict[str, Any]:
    """The OCI ``linux.seccomp`` object for a sandbox: ``{"defaultAction": "SCMP_ACT_ALLOW", "architectures":
    [...], "syscalls": [{"names", "action", "errnoRet", "args"?}, ...]}``.

    Every listed call fails with ``EPERM`` (errno 1) except the keyring calls and ``clone3`` (``ENOSYS``, 38);
    ``clone``'s flags are
    its first argument on x86 (index 0), as are ``unshare``'s. A fresh dict on each call (callers may edit it).
    """
    denied = [name for names in DENIED.values() for name in names]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": list(ARCHITECTURES),
        "syscalls": [
            {"names": denied, "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
            {"names": list(NOT_IMPLEMENTED), "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
            _masked("unshare", 0, CLONE_NEWUSER),
            _masked("clone", 0, CLONE_NEWUSER),
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        ],
    }
