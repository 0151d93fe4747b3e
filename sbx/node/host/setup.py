"""Prepare a Debian host to run sandboxes (``sbx setup``) and check it (``sbx doctor``).

:func:`setup_host` is idempotent; each step does only what is missing:

1. host packages (:data:`HOST_PACKAGES`) with ``apt-get install`` for those ``dpkg-query`` does not report as
   installed;
2. CRIU :data:`~sbx.node.host.criuinstall.CRIU_VERSION` from Debian sid into ``settings.criu_dir``, beside the host's
   own packages (:func:`sbx.node.host.criuinstall.install_criu`);
3. the reflink XFS data volume (:func:`sbx.storage.volume.ensure_volume`);
4. the base image (:func:`sbx.node.host.image.ensure_image`);
5. gVisor's ``runsc`` from Debian trixie at :data:`~sbx.node.host.runscinstall.RUNSC_PATH`, for the ``gvisor`` runtime
   class (:func:`sbx.node.host.runscinstall.install_runsc`).

:func:`doctor` reports what is in place as a list of :class:`Check`.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sbx.config import Settings
from sbx.node.container import lxcfs
from sbx.node.host import image as image_mod
from sbx.node.host import limits
from sbx.node.host.criuinstall import (
    CRIU_VERSION,
    HostSetupError,
    Progress,
    criu_wrapper,
    install_criu,
    installed_criu_version,
    quiet,
    run_step,
    version_tuple,
)
from sbx.node.host.runscinstall import RUNSC_PATH, install_runsc, installed_runsc_version

#: Debian packages the host needs (runc; image builds: the default image, and images from a Dockerfile or an OCI
#: image with buildah, skopeo and umoci, tini's static build for images without systemd; disks and the XFS volume;
#: networking; uid maps).
HOST_PACKAGES = (
    "runc",
    "mmdebstrap",
    "buildah",
    "skopeo",
    "umoci",
    "tini",
    "xfsprogs",
    "e2fsprogs",
    "iproute2",
    "nftables",
    "iptables",
    "uidmap",
    "util-linux",
    "jq",
    "debian-archive-keyring",
    "lxcfs",
    "openssh-client",
)


@dataclass
class Check:
    """One ``sbx doctor`` line: ``name``, ``ok``, ``detail`` (what was found) and ``fix`` (what to do when not
    ok; empty when ok)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


# --------------------------------------------------------------------------------------------------------
# Host packages


def missing_packages(names: tuple[str, ...] | list[str] = HOST_PACKAGES) -> list[str]:
    """The packages among ``names`` that ``dpkg-query`` does not report as installed."""
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package}\t${db:Status-Status}\n", *names],
        capture_output=True,
        text=True,
    )
    installed = {
        line.split("\t")[0]
        for line in proc.stdout.splitlines()
        if line.count("\t") == 1 and line.split("\t")[1] == "installed"
    }
    return [n for n in names if n not in installed]


def install_host_packages(progress: Progress | None = None) -> list[str]:
    """``apt-get install`` the missing :data:`HOST_PACKAGES` (after ``apt-get update`` if a first try fails).
    Returns the names installed (empty when nothing was missing). Raises :class:`HostSetupError`."""
    say = progress or quiet
    missing = missing_packages()
    if not missing:
        say("Host packages: all present")
        return []
    say(f"Installing host packages: {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    argv = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    try:
        run_step(argv, "apt-get install", env)
    except HostSetupError:
        say("apt-get install failed; refreshing package lists and retrying")
        run_step(["apt-get", "update", "-q"], "apt-get update", env)
        run_step(argv, "apt-get install", env)
    return missing


# --------------------------------------------------------------------------------------------------------
# Setup and doctor


def setup_host(settings: Settings, progress: Progress | None = None) -> Path:
    """Prepare this host for sandboxes; safe to run again (each step skips what is already done).

    Steps: host packages, CRIU from sid (:func:`install_criu`), runsc from trixie (:func:`install_runsc`), the
    reflink XFS volume
    (:func:`sbx.storage.volume.ensure_volume`), kernel limits (:func:`sbx.node.host.limits.apply`: inotify, pids,
    conntrack, written to ``/etc/sysctl.d/60-sbx.conf``; keys it can't raise are reported), the base image
    (:func:`sbx.node.host.image.ensure_image`).
    Returns the base image path. Needs root and network access to the host's Debian mirror. Raises
    :class:`HostSetupError`, :class:`sbx.node.host.image.ImageError` or the storage layer's error.
    """
    say = progress or quiet
    install_host_packages(say)
    install_criu(settings, say)
    install_runsc(settings.home / "runsc-apt", say)
    from sbx.storage.volume import ensure_volume

    say(f"Data volume: {settings.volume}")
    ensure_volume(settings)
    for lim in limits.apply():
        if lim.error:
            say(f"Kernel limit {lim.key}: {lim.current} (wanted >= {lim.wanted}): {lim.error}")
    say(f"Kernel limits: {limits.SYSCTL_FILE}")
    return image_mod.ensure_image(settings, say)


def _probe(argv: list[str], timeout: float = 30) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def promised_disk_bytes(settings: Settings) -> int:
    """Bytes the sandbox disks on the data volume may grow to together: the apparent sizes of every node's
    ``sandboxes/*/disk.ext4`` (sparse files: each holds only what its sandbox wrote). 0 when there are none."""
    total = 0
    for disk in (settings.volume / "nodes").glob("*/sandboxes/*/disk.ext4"):
        try:
            total += disk.stat().st_size
        except OSError:
            continue
    return total


def overcommit(settings: Settings, volume_bytes: int) -> str:
    """One line on the overcommit of sparse disks (issue 36): what the sandbox disks may grow to
    (:func:`promised_disk_bytes`) against the volume's size (``volume_bytes``) and the room left where the volume runs
    out first (:func:`sbx.storage.volume.free_space`), e.g. ``"sandbox disks may grow to 240 GiB: 1.20x the 200
    GiB volume, 3.20x the 75 GiB of room left"``."""
    from sbx.storage.volume import free_space

    promised = promised_disk_bytes(settings)
    room = free_space(settings).free_bytes
    gib = 2**30

    def ratio(n: int) -> str:
        return f"{promised / n:.2f}x" if n > 0 else "-"

    return (f"sandbox disks may grow to {promised / gib:.0f} GiB: {ratio(volume_bytes)} the {volume_bytes / gib:.0f} "
            f"GiB volume, {ratio(room)} the {room / gib:.0f} GiB of room left")


def _check_volume(settings: Settings) -> Check:
    fix = "run `sbx setup` (creates and mounts the reflink XFS volume)"
    status_fn: Callable[[Settings], dict[str, Any]] | None
    try:
        from sbx.storage.volume import volume_status as status_fn
    except ImportError:
        status_fn = None
    if status_fn is not None:
        st = status_fn(settings)
        ok = bool(st.get("mounted")) and st.get("fstype") == "xfs" and bool(st.get("reflink"))
        free = int(st.get("free_bytes") or 0) // 2**30
        detail = (
            f"{st.get('path')}: {st.get('fstype') or 'not mounted'}, "
            f"reflink={'yes' if st.get('reflink') else 'no'}" + (f", {free} GiB free" if st.get("mounted") else "")
        )
        if st.get("mounted"):
            detail += "; " + overcommit(settings, int(st.get("size_bytes") or 0))
        return Check("data volume", ok, detail, "" if ok else fix)
    code, out = _probe(["findmnt", "-n", "-o", "FSTYPE", "--mountpoint", str(settings.volume)])
    if code != 0 or out != "xfs":
        return Check("data volume", False, f"{settings.volume}: {out or 'not mounted'}", fix)
    code, info = _probe(["xfs_info", str(settings.volume)])
    ok = "reflink=1" in info
    return Check("data volume", ok, f"{settings.volume}: xfs, reflink={'yes' if ok else 'no'}", "" if ok else fix)


def doctor(settings: Settings) -> list[Check]:
    """Check the host: runc, the CRIU wrapper and its version, ``criu check``, mmdebstrap, the data volume,
    the base image, the cgroup v1 memory controller, the kernel, user namespaces, IPv4 forwarding and the kernel
    limits of :mod:`sbx.node.host.limits` (one ``sysctl <key>`` check each). Never
    raises; each :class:`Check` says what was found and how to fix it."""
    checks: list[Check] = []
    setup_fix = "run `sbx setup`"

    runc = shutil.which("runc")
    if runc:
        _, out = _probe([runc, "--version"])
        checks.append(Check("runc", True, out.splitlines()[0] if out else runc))
    else:
        checks.append(Check("runc", False, "runc not found on PATH", "apt-get install runc (or `sbx setup`)"))
    runsc = installed_runsc_version()
    checks.append(Check("runsc", runsc is not None, runsc or f"{RUNSC_PATH} missing or does not run",
                        "" if runsc else setup_fix))

    version = installed_criu_version(settings)
    wrapper = criu_wrapper(settings)
    if version is None:
        checks.append(Check("criu", False, f"{wrapper} missing or does not run", setup_fix))
    else:
        ok = version_tuple(version) >= version_tuple(CRIU_VERSION)
        detail = f"{wrapper}: CRIU {version}" + ("" if version == CRIU_VERSION else f" (tested: {CRIU_VERSION})")
        checks.append(Check("criu", ok, detail, "" if ok else setup_fix))

    if version is None:
        checks.append(Check("criu check", False, "CRIU not installed", setup_fix))
    else:
        code, out = _probe([str(wrapper), "check"], timeout=60)
        ok = code == 0 and "Looks good" in out
        last = out.splitlines()[-1] if out else f"exit {code}"
        checks.append(Check("criu check", ok, last, "" if ok else "see `criu check` output; needs root"))

    mm = shutil.which("mmdebstrap")
    checks.append(Check("mmdebstrap", mm is not None, mm or "not found", "" if mm else "apt-get install mmdebstrap"))

    checks.append(_check_volume(settings))

    img = image_mod.image_path(settings)
    if img.is_file():
        size = img.stat().st_size // 2**20
        checks.append(Check("base image", True, f"{img.name} ({size} MiB)"))
    else:
        checks.append(Check("base image", False, f"{img} not built", setup_fix))

    mem = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    checks.append(
        Check(
            "cgroup v1 memory controller",
            mem.exists(),
            "/sys/fs/cgroup/memory" if mem.exists() else "no /sys/fs/cgroup/memory hierarchy",
            "" if mem.exists() else "boot with the cgroup v1 memory controller mounted at /sys/fs/cgroup/memory",
        )
    )

    release = platform.release()
    kv = version_tuple(release)
    ok = kv >= (5, 10)
    checks.append(Check("kernel", ok, release, "" if ok else "CRIU and runc need Linux >= 5.10"))

    userns = Path("/proc/sys/user/max_user_namespaces")
    try:
        n = int(userns.read_text())
    except (OSError, ValueError):
        n = 0
    checks.append(
        Check(
            "user namespaces",
            n > 0,
            f"max_user_namespaces={n}",
            "" if n > 0 else "sysctl -w user.max_user_namespaces=15000",
        )
    )

    fwd = Path("/proc/sys/net/ipv4/ip_forward")
    try:
        value = fwd.read_text().strip()
        ok = value == "1" or os.access(fwd, os.W_OK)
        detail = f"ip_forward={value}" + ("" if value == "1" else " (sbx turns it on)" if ok else "")
    except OSError as e:
        ok, detail = False, str(e)
    checks.append(Check("ip forwarding", ok, detail, "" if ok else "run as root; allow net.ipv4.ip_forward=1"))

    checks.append(_check_lxcfs())
    for lim in limits.read():
        shown = "absent" if lim.current is None else str(lim.current)
        checks.append(Check(f"sysctl {lim.key}", lim.ok, f"{shown} (wanted >= {lim.wanted})",
                            "" if lim.ok else f"run `sbx setup` (writes {limits.SYSCTL_FILE})"))
    return checks


def _check_lxcfs() -> Check:
    """LXCFS gives each sandbox its own /proc/meminfo and uptime. Not running is fine (the node starts it);
    a mount whose daemon died is reported, and the next boot replaces it."""
    if shutil.which("lxcfs") is None:
        return Check("lxcfs", False, "not installed: sandboxes see the host's memory", "apt-get install lxcfs")
    if not lxcfs.is_mounted():
        return Check("lxcfs", True, f"installed; the node starts it at {lxcfs.LXCFS_DIR}")
    if lxcfs.is_alive():
        return Check("lxcfs", True, f"running at {lxcfs.LXCFS_DIR}")
    return Check("lxcfs", False, f"{lxcfs.LXCFS_DIR} is mounted but its daemon died",
                 "nothing to do: the next boot detaches it and starts lxcfs again")
