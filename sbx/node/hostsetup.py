"""Prepare a Debian host to run sandboxes (``sbx setup``) and check it (``sbx doctor``).

:func:`setup_host` is idempotent; each step does only what is missing:

1. host packages (:data:`HOST_PACKAGES`) with ``apt-get install`` for those ``dpkg-query`` does not report as
   installed;
2. CRIU :data:`CRIU_VERSION` from Debian sid into ``settings.criu_dir`` (bookworm's CRIU 3.17 fails on kernels
   >= 6.13 and trixie's 4.1.1 on >= 6.16; runtime-facts). The ordinary ``apt-get`` downloads sid's ``criu``
   and ``iptables`` with their libraries, using a private configuration under ``criu_dir/apt`` (own sources list
   on the host's Debian mirror URI, own state and cache, an empty dpkg status, no Recommends) so the host's
   package database is never touched. ``dpkg-deb -x`` unpacks every package into ``criu_dir/root``, and
   wrapper scripts run sid's binaries through sid's own dynamic loader with ``--library-path`` (sid's CRIU
   needs a newer glibc than bookworm's):

   - ``criu_dir/criu`` (what runc's ``--criu`` flag points at) and the same in ``criu_dir/bin/criu``;
   - ``criu_dir/bin/iptables``, ``iptables-restore``, ``iptables-save`` and the ``ip6tables`` ones (sid's
     nft-based iptables, for CRIU's network lock of images dumped with one: sbx's own skip it); put
     ``criu_dir/bin`` first on ``PATH`` to use them;

3. the reflink XFS data volume (:func:`sbx.storage.volume.ensure_volume`);
4. the base image (:func:`sbx.node.image.ensure_image`).

:func:`doctor` reports what is in place as a list of :class:`Check`.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sbx.config import Settings
from sbx.node import image as image_mod
from sbx.node import limits, lxcfs
from sbx.node.tools import run_checked
from sbx.node.types import NodeError

Progress = Callable[[str], None]

#: Debian packages the host needs (runc; image build; disks and the XFS volume; networking; uid maps).
HOST_PACKAGES = (
    "runc",
    "mmdebstrap",
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

#: The CRIU release sbx is tested with (Debian sid's package).
CRIU_VERSION = "4.2.1"
#: Packages taken from sid for ``criu_dir`` (their dependencies come along).
CRIU_PACKAGES = ("criu", "iptables")
CRIU_SUITE = "sid"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"

#: Debian architecture -> (multiarch triplet, dynamic loader file name).
_LOADERS = {
    "amd64": ("x86_64-linux-gnu", "ld-linux-x86-64.so.2"),
    "arm64": ("aarch64-linux-gnu", "ld-linux-aarch64.so.1"),
}

#: Wrapper name in ``criu_dir/bin`` -> the name xtables-nft-multi (under ``root/usr/sbin``) dispatches on.
_XTABLES_WRAPPERS = {
    "iptables": "iptables-nft",
    "iptables-restore": "iptables-nft-restore",
    "iptables-save": "iptables-nft-save",
    "ip6tables": "ip6tables-nft",
    "ip6tables-restore": "ip6tables-nft-restore",
    "ip6tables-save": "ip6tables-nft-save",
}


class HostSetupError(NodeError):
    """A host setup step failed (code ``host_setup_failed``); ``message`` names the step and the tool's
    output."""

    def __init__(self, message: str, code: str = "host_setup_failed"):
        super().__init__(code, message)


@dataclass
class Check:
    """One ``sbx doctor`` line: ``name``, ``ok``, ``detail`` (what was found) and ``fix`` (what to do when not
    ok; empty when ok)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


def _noop(_msg: str) -> None:
    return None


def _run(argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
    return run_checked(argv, what, HostSetupError, env=env).stdout


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
    say = progress or _noop
    missing = missing_packages()
    if not missing:
        say("Host packages: all present")
        return []
    say(f"Installing host packages: {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    argv = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    try:
        _run(argv, "apt-get install", env)
    except HostSetupError:
        say("apt-get install failed; refreshing package lists and retrying")
        _run(["apt-get", "update", "-q"], "apt-get update", env)
        _run(argv, "apt-get install", env)
    return missing


# --------------------------------------------------------------------------------------------------------
# CRIU from sid


def _arch() -> str:
    return _run(["dpkg", "--print-architecture"], "dpkg --print-architecture").strip()


def _loader(arch: str) -> tuple[str, str]:
    try:
        return _LOADERS[arch]
    except KeyError:
        raise HostSetupError(f"no CRIU install recipe for architecture {arch!r}") from None


def criu_wrapper(settings: Settings) -> Path:
    """The ``criu`` wrapper runc runs (``settings.criu_dir / "criu"``)."""
    return settings.criu_dir / "criu"


def installed_criu_version(settings: Settings) -> str | None:
    """Version reported by ``criu --version`` through the wrapper (``"4.2.1"``); ``None`` if it can't run."""
    wrapper = criu_wrapper(settings)
    if not wrapper.exists():
        return None
    try:
        out = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Version:\s*(\S+)", out)
    return m.group(1) if m else None


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("-")[0].split("~")[0])[:3])


class _PrivateApt:
    """The ordinary apt client with a private configuration under ``base`` (sources, state, cache, dpkg
    status), so nothing of the host's own apt state is read or changed besides its ``apt.conf.d`` (proxy settings)."""

    def __init__(self, base: Path, mirror: str):
        self.base = base
        self.mirror = mirror
        self.archives = base / "var/cache/apt/archives"

    def prepare(self) -> None:
        for d in (
            "etc/sources.list.d",
            "etc/preferences.d",
            "var/lib/apt/lists/partial",
            "var/cache/apt/archives/partial",
            "var/lib/dpkg",
        ):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        (self.base / "etc/sources.list").write_text(f"deb [signed-by={KEYRING}] {self.mirror} {CRIU_SUITE} main\n")
        (self.base / "var/lib/dpkg/status").write_text("")

    def options(self) -> list[str]:
        b = self.base
        opts = {
            "Dir::Etc::SourceList": b / "etc/sources.list",
            "Dir::Etc::SourceParts": b / "etc/sources.list.d",
            "Dir::Etc::Preferences": b / "etc/preferences",
            "Dir::Etc::PreferencesParts": b / "etc/preferences.d",
            "Dir::State": b / "var/lib/apt",
            "Dir::State::status": b / "var/lib/dpkg/status",
            "Dir::Cache": b / "var/cache/apt",
            "APT::Install-Recommends": "false",
            "APT::Install-Suggests": "false",
            "Acquire::Languages": "none",
        }
        out: list[str] = []
        for key, value in opts.items():
            out += ["-o", f"{key}={value}"]
        return out

    def run(self, tool: str, *args: str) -> str:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        return _run([tool, *self.options(), *args], f"{tool} {' '.join(args)}", env)

    def candidate(self, package: str) -> str | None:
        out = self.run("apt-cache", "policy", package)
        m = re.search(r"Candidate:\s*(\S+)", out)
        return m.group(1) if m and m.group(1) != "(none)" else None


def install_criu(settings: Settings, progress: Progress | None = None) -> str:
    """Install CRIU from Debian sid into ``settings.criu_dir`` unless the wrapper already reports
    :data:`CRIU_VERSION`. Returns the installed version. Raises :class:`HostSetupError` when sid has no CRIU
    at least as new as :data:`CRIU_VERSION`, a download fails, or the unpacked CRIU does not run."""
    say = progress or _noop
    have = installed_criu_version(settings)
    if have == CRIU_VERSION:
        say(f"CRIU {have}: already installed in {settings.criu_dir}")
        return have
    arch = _arch()
    triplet, loader = _loader(arch)
    try:
        mirror = image_mod.debian_mirror()
    except image_mod.ImageError as e:
        raise HostSetupError(e.message, code=e.code) from e
    criu_dir = settings.criu_dir
    criu_dir.mkdir(parents=True, exist_ok=True)
    apt = _PrivateApt(criu_dir / "apt", mirror)
    apt.prepare()
    say(f"Fetching the Debian {CRIU_SUITE} package index from {mirror}")
    apt.run("apt-get", "update", "-q")
    candidate = apt.candidate("criu")
    if candidate is None or _version_tuple(candidate) < _version_tuple(CRIU_VERSION):
        raise HostSetupError(f"Debian {CRIU_SUITE} offers criu {candidate or 'none'}, need >= {CRIU_VERSION}")
    if not candidate.startswith(CRIU_VERSION):
        say(f"warning: {CRIU_SUITE} has criu {candidate}; sbx is tested with {CRIU_VERSION}")
    for deb in apt.archives.glob("*.deb"):
        deb.unlink()
    say(f"Downloading criu {candidate} and its libraries from {CRIU_SUITE}")
    apt.run("apt-get", "install", "-y", "-q", "--download-only", *CRIU_PACKAGES)
    debs = sorted(apt.archives.glob("*.deb"))
    if not debs:
        raise HostSetupError("apt-get downloaded no packages for criu")

    new_root = criu_dir / "root.new"
    shutil.rmtree(new_root, ignore_errors=True)
    new_root.mkdir()
    say(f"Unpacking {len(debs)} packages into {criu_dir / 'root'}")
    for deb in debs:
        _run(["dpkg-deb", "-x", str(deb), str(new_root)], f"dpkg-deb -x {deb.name}")
    old_root = criu_dir / "root.old"
    shutil.rmtree(old_root, ignore_errors=True)
    root = criu_dir / "root"
    if root.exists():
        root.rename(old_root)
    new_root.rename(root)
    shutil.rmtree(old_root, ignore_errors=True)
    for deb in debs:
        deb.unlink()
    # The sid package index is only needed again for the next version change; don't keep ~20 MiB of it.
    shutil.rmtree(apt.base / "var/lib/apt/lists", ignore_errors=True)

    write_wrappers(criu_dir, triplet, loader)
    version = installed_criu_version(settings)
    if version is None:
        raise HostSetupError(f"the unpacked CRIU does not run: {criu_wrapper(settings)} --version failed")
    (criu_dir / "VERSION").write_text(f"{candidate}\n")
    say(f"CRIU {version} installed in {criu_dir}")
    return version


def _wrapper_text(root: Path, triplet: str, loader: str, program: str, extra: str = "") -> str:
    lib = f"$ROOT/usr/lib/{triplet}"
    return (
        "#!/bin/sh\n"
        "# Written by sbx (sbx.node.hostsetup): a program from Debian sid, run through sid's own dynamic\n"
        "# loader and libraries, because it needs a newer glibc than the host's.\n"
        f"ROOT={shlex.quote(str(root))}\n"
        f"{extra}"
        f'exec "{lib}/{loader}" --library-path "{lib}" {program} "$@"\n'
    )


def write_wrappers(criu_dir: Path, triplet: str = "x86_64-linux-gnu", loader: str = "ld-linux-x86-64.so.2") -> None:
    """Write ``criu_dir/criu``, ``criu_dir/bin/criu`` and the iptables wrappers in ``criu_dir/bin``
    (mode 0755), all running programs under ``criu_dir/root``."""
    root = criu_dir / "root"
    bin_dir = criu_dir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    criu_text = _wrapper_text(root, triplet, loader, '"$ROOT/usr/sbin/criu"')
    for path in (criu_dir / "criu", bin_dir / "criu"):
        _write_exec(path, criu_text)
    xtables_env = f'XTABLES_LIBDIR="$ROOT/usr/lib/{triplet}/xtables"\nexport XTABLES_LIBDIR\n'
    for name, program in _XTABLES_WRAPPERS.items():
        # xtables-nft-multi picks the tool from argv[0]; ld.so's --argv0 sets it.
        prog = f'--argv0 {program} "$ROOT/usr/sbin/xtables-nft-multi"'
        _write_exec(bin_dir / name, _wrapper_text(root, triplet, loader, prog, xtables_env))


def _write_exec(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------------
# Setup and doctor


def setup_host(settings: Settings, progress: Progress | None = None) -> Path:
    """Prepare this host for sandboxes; safe to run again (each step skips what is already done).

    Steps: host packages, CRIU from sid (:func:`install_criu`), the reflink XFS volume
    (:func:`sbx.storage.volume.ensure_volume`), kernel limits (:func:`sbx.node.limits.apply`: inotify, pids,
    conntrack, written to ``/etc/sysctl.d/60-sbx.conf``; keys it can't raise are reported), the base image
    (:func:`sbx.node.image.ensure_image`).
    Returns the base image path. Needs root and network access to the host's Debian mirror. Raises
    :class:`HostSetupError`, :class:`sbx.node.image.ImageError` or the storage layer's error.
    """
    say = progress or _noop
    install_host_packages(say)
    install_criu(settings, say)
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
    limits of :mod:`sbx.node.limits` (one ``sysctl <key>`` check each). Never
    raises; each :class:`Check` says what was found and how to fix it."""
    checks: list[Check] = []
    setup_fix = "run `sbx setup`"

    runc = shutil.which("runc")
    if runc:
        _, out = _probe([runc, "--version"])
        checks.append(Check("runc", True, out.splitlines()[0] if out else runc))
    else:
        checks.append(Check("runc", False, "runc not found on PATH", "apt-get install runc (or `sbx setup`)"))

    version = installed_criu_version(settings)
    wrapper = criu_wrapper(settings)
    if version is None:
        checks.append(Check("criu", False, f"{wrapper} missing or does not run", setup_fix))
    else:
        ok = _version_tuple(version) >= _version_tuple(CRIU_VERSION)
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
    kv = _version_tuple(release)
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
