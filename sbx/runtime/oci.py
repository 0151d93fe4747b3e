"""The OCI runtime spec (``config.json``) of a machine-like sandbox.

A sandbox is a runc container that behaves like a small machine: systemd 252 as PID 1, its own user, pid, mount,
uts, ipc, cgroup and network namespaces, tmpfs ``/run``, ``/run/lock`` and ``/tmp``. The choices below come from
what was measured to let CRIU checkpoint such a container on this kernel (``shared/notes/runtime-facts.md``):

- a user namespace (without one CRIU fails with "Can't get rlimit" for services running as non-root, the host
  lacking ``CAP_SYS_RESOURCE``) whose map shifts sandbox uids/gids 0..65535 to the sandbox's own host range
  ``uid_base``.. (issue 17: the sandbox's root is no uid the host knows); the root path is an idmapped mount of
  the disk (:mod:`sbx.storage.idmap`) and the prestart hook delegates the cgroups
  (:mod:`sbx.node.container.cgdelegate`);
- runc creates the network namespace itself and a ``prestart`` hook wires the veth, because runc runs the
  hook again on restore (a netns made with ``ip netns add`` does not mix with a user namespace);
- ``container=oci`` in the environment and SIGRTMIN+3 (37) to ask systemd to halt;
- the default seccomp profile of :mod:`sbx.runtime.seccomp` and the masks of :data:`MASKED_PATHS`.

The layout follows the OCI runtime spec, config.json section (opencontainers/runtime-spec ``config.md``).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sbx.runtime import seccomp

# Capabilities granted to PID 1. The host's bounding set lacks CAP_SYS_RESOURCE (runtime-facts), so it is left
# out: asking runc for a capability outside the bounding set fails the start.
CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD",
    "CAP_LEASE", "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_SYSLOG", "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_CHECKPOINT_RESTORE",
]

# systemd's halt request (man systemd, "Signals": SIGRTMIN+3).
STOP_SIGNAL = 37

# uid/gid map size: sandbox ids 0..65535 map to host uid_base..uid_base+65535.
ID_MAP_SIZE = 65536

CFS_PERIOD_US = 100_000

# What is hidden (an empty read-only tmpfs from runc over a directory, or a read-only bind of the node's empty mask
# filesystem for the /sys ones when the node gives one: ContainerSpec.mask_dir; /dev/null over a file): Docker's
# default list, then host facts that are not the sandbox's business: the host's kernel command line and boot
# parameters, its block devices, the per-device ext4/xfs statistics (named after the loop devices), the kernel log
# and debugfs. runc 1.1 makes these mounts inside the sandbox's own user namespace, so the kernel does not lock them:
# root inside can unmount them or mount a fresh proc or sysfs beside them (measured, issue 33; a locked mount must
# come from a more privileged mount namespace copied into the sandbox's, which runc 1.1 does not do and a CRIU
# restore would not keep). So what they hide is made harmless where it can be: a sandbox disk's loop device names
# only ``/disk.ext4`` as its backing file (sbx.storage.loopdev; it used to name every sandbox disk on the node with
# its id and host path), and the /sys masks show in mountinfo as ``/`` of a tmpfs ``sbx-masked``
# (:func:`ensure_mask_dir`; they used to show ``/run/sbx/<node>/bundles/<id>/masked``). The host's kernel command
# line stays the host's. What the masks guard against writes is guarded again by the uid map. /proc/sys is not
# read-only: that would take the sandbox's own net.* with it (Docker inside sets net.ipv4.ip_forward), and runc 1.1
# cannot carve a writable /proc/sys/net back out (it refuses any mount "inside /proc"; measured). The uid map refuses
# writes to the host's (non-net) sysctls.
MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
    "/proc/cmdline", "/proc/partitions", "/proc/kmsg",
    "/sys/block", "/sys/class/block", "/sys/dev/block", "/sys/devices/virtual/block",
    "/sys/fs/ext4", "/sys/fs/xfs", "/sys/kernel/debug", "/sys/kernel/boot_params", "/sys/kernel/vmcoreinfo",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sysrq-trigger"]
MASK_BIND_OPTIONS = ["bind", "ro", "nosuid", "nodev", "noexec"]

# The /proc files LXCFS virtualizes per container.
LXCFS_PROC_FILES = ["cpuinfo", "diskstats", "loadavg", "meminfo", "stat", "swaps", "uptime"]


@dataclass
class ContainerSpec:
    """Inputs for :func:`build_config`.

    - ``hostname``: the UTS hostname.
    - ``memory_bytes``: memory-cgroup limit (swap limited to the same figure, so no swap).
    - ``vcpus``: CFS quota in whole CPUs (``nproc`` inside still shows the host's cores; see ``cpuset_cpus``).
    - ``cpuset_cpus``: host CPUs the sandbox may run on (``"0-1"``), so ``nproc`` shows min(vCPUs, host cores).
    - ``cgroup_path``: path of the container's cgroup under each controller, e.g. ``/sbx/node0/sb_x``.
    - ``hook_argv``: the command runc runs as a ``prestart`` hook (network wiring) on create and restore.
    - ``pids_limit``: max tasks.
    - ``cpu_shares``: CPU weight among the node's sandboxes (cgroup v1 ``cpu.shares``; None: the kernel's 1024).
    - ``uid_base``: first host uid/gid of the sandbox's map (0: the identity map of sandboxes made before
      shifted maps).
    - ``lxcfs_dir``: where LXCFS is mounted on the host (``/var/lib/lxcfs``); when set, its per-container
      ``/proc`` files are bind-mounted over the container's, so ``free`` shows the memory limit and ``uptime``
      the sandbox's own boot (LXCFS docs: the ``proc/*`` files it serves). CRIU treats them as external bind
      mounts and restores them (measured).
    - ``init_args``: the container's PID 1 and its arguments (default ``["/sbin/init"]``: systemd; an image without
      systemd gets sbx's minimal init, :mod:`sbx.guest.minimal`).
    - ``mask_dir``: a host directory that stays empty, owned by host root, mode 0555: the node's mask filesystem
      (:func:`ensure_mask_dir`, a read-only tmpfs, so mountinfo names no host path). When set, each directory of
      :data:`MASKED_PATHS` under ``/sys`` is a read-only bind mount of it instead of runc's read-only tmpfs
      (:func:`masks`): CRIU runs ``tar`` for every tmpfs it dumps and again to restore it (~4.5 ms each here, ten
      masks), while a bind mount from the host is an external mount it only names. Root inside sees an empty
      directory either way; unmounted, either shows the same sysfs directory; and remounted read-write, the bind
      still refuses writes (the filesystem is read-only and its root is host root's, unmapped in the sandbox's user
      namespace, so its root is "other" there).
    """

    hostname: str
    memory_bytes: int
    vcpus: int
    cpuset_cpus: str
    cgroup_path: str
    hook_argv: list[str] = field(default_factory=list)
    hook_env: list[str] = field(default_factory=list)
    pids_limit: int = 8192
    cpu_shares: int | None = None
    lxcfs_dir: str | None = None
    uid_base: int = 0
    mask_dir: str | None = None
    annotations: dict[str, str] = field(default_factory=dict)
    init_args: list[str] | None = None


def mount_targets(config: dict[str, Any]) -> list[tuple[str, bool]]:
    """``(destination, is_file)`` of every mount in ``config`` whose target runc's restore creates on the root
    path: all but the cgroup mount and those below a tmpfs of the config (CRIU restores a tmpfs with its content),
    as runc's restore does (LXCFS binds its files over ``/proc/<name>``, the masks bind over ``/sys/<dir>``:
    measured, runc makes those targets on the disk itself, where the procfs or sysfs covers them later). A bind
    of a file source is a file target."""
    mounts = config.get("mounts", [])
    tmpfs = {m["destination"] for m in mounts if m.get("type") == "tmpfs"}
    out = []
    for m in mounts:
        dest = m["destination"]
        if m.get("type") == "cgroup" or any(dest.startswith(v + "/") for v in tmpfs):
            continue
        is_file = m.get("type") == "bind" and (dest.startswith("/proc/") or os.path.isfile(m.get("source", "")))
        out.append((dest, is_file))
    return out


#: mount(8) options of the node's mask filesystem (:func:`ensure_mask_dir`): read-only, empty, host root's, room
#: for nothing.
MASK_FS_OPTIONS = "ro,nosuid,nodev,noexec,mode=0555,uid=0,gid=0,size=4k,nr_inodes=8"
MASK_FS_SOURCE = "sbx-masked"


def ensure_mask_dir(path: Path) -> Path:
    """Make ``path`` the node's mask directory (:attr:`ContainerSpec.mask_dir`) and return it: an empty read-only
    tmpfs of its own (source ``sbx-masked``, root 0555 owned by host root), mounted once per node and kept (again
    after a reboot or when something else was found there). The masks bind its root, so what a sandbox's
    ``/proc/self/mountinfo`` shows of them is ``/`` of that tmpfs, never a host path or a sandbox id (the masks
    used to show ``/run/sbx/<node>/bundles/<id>/masked``, measured). Raises ``OSError`` when it can't be mounted."""
    if os.path.ismount(path):
        return path
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    path.mkdir(mode=0o555, parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", MASK_FS_OPTIONS, MASK_FS_SOURCE, str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"mounting the mask filesystem at {path}: {done.stderr.strip()}")
    return path


def masks(mask_dir: str | None) -> tuple[list[str], list[dict[str, Any]]]:
    """``(maskedPaths, bind mounts)`` for :data:`MASKED_PATHS`: without ``mask_dir`` everything goes to runc's
    ``maskedPaths``; with it, the paths under ``/sys`` that are directories on this host (a sandbox's sysfs shows
    the host's, but for its own network devices) become read-only binds of ``mask_dir`` (see
    :class:`ContainerSpec`). runc refuses bind mounts inside ``/proc``, so those stay masked by runc."""
    if mask_dir is None:
        return list(MASKED_PATHS), []
    binds = [p for p in MASKED_PATHS if p.startswith("/sys/") and os.path.isdir(p)]
    mounts = [{"destination": p, "type": "bind", "source": mask_dir, "options": list(MASK_BIND_OPTIONS)}
              for p in binds]
    return [p for p in MASKED_PATHS if p not in binds], mounts


def build_config(spec: ContainerSpec, rootfs: str = "rootfs") -> dict[str, Any]:
    """Return the OCI ``config.json`` document (a dict) for ``spec``; ``rootfs`` is relative to the bundle."""
    caps = list(CAPABILITIES)
    idmap = [{"containerID": 0, "hostID": spec.uid_base, "size": ID_MAP_SIZE}]
    hooks: dict[str, Any] = {}
    if spec.hook_argv:
        hooks["prestart"] = [
            {"path": spec.hook_argv[0], "args": spec.hook_argv, "env": spec.hook_env, "timeout": 30}
        ]
    tmp_opts = ["nosuid", "nodev", "mode=1777"]
    lxcfs_mounts = [
        {"destination": f"/proc/{name}", "type": "bind", "source": f"{spec.lxcfs_dir}/proc/{name}",
         "options": ["rbind", "rw"]}
        for name in LXCFS_PROC_FILES
    ] if spec.lxcfs_dir else []
    masked, mask_mounts = masks(spec.mask_dir)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(spec.init_args or ["/sbin/init"]),
            "env": [
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "container=oci",
                "TERM=xterm",
            ],
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted", "inheritable")},
            "noNewPrivileges": False,
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "nodev", "mode=1777"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["nosuid", "noexec", "nodev", "relatime", "rw"]},
            *mask_mounts,
            {"destination": "/run", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=755"]},
            {"destination": "/run/lock", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "noexec", "mode=1777", "size=5m"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": tmp_opts},
            *lxcfs_mounts,
        ],
        "hooks": hooks,
        "annotations": dict(spec.annotations),
        "linux": {
            "uidMappings": idmap,
            "gidMappings": idmap,
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "user", "cgroup")],
            "cgroupsPath": spec.cgroup_path,
            "resources": {
                "devices": [{"allow": False, "access": "rwm"}],
                "memory": {"limit": spec.memory_bytes, "swap": spec.memory_bytes},
                "cpu": {"quota": spec.vcpus * CFS_PERIOD_US, "period": CFS_PERIOD_US, "cpus": spec.cpuset_cpus,
                        **({"shares": spec.cpu_shares} if spec.cpu_shares else {})},
                "pids": {"limit": spec.pids_limit},
            },
            "maskedPaths": masked,
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": seccomp.default_profile(),
        },
    }
