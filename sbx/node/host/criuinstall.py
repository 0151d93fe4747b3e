"""CRIU for ``sbx setup`` (:mod:`sbx.node.host.setup`): Debian sid's CRIU :data:`CRIU_VERSION` installed under
``settings.criu_dir`` without touching the host's own packages.

Bookworm's CRIU 3.17 fails on kernels >= 6.13 and trixie's 4.1.1 on >= 6.16 (runtime-facts). The ordinary
``apt-get`` downloads sid's ``criu`` and ``iptables`` with their libraries, using a private configuration under
``criu_dir/apt`` (own sources list on the host's Debian mirror URI, own state and cache, an empty dpkg status, no
Recommends) so the host's package database is never touched. ``dpkg-deb -x`` unpacks every package into
``criu_dir/root``, and wrapper scripts run sid's binaries through sid's own dynamic loader with ``--library-path``
(sid's CRIU needs a newer glibc than bookworm's):

- ``criu_dir/criu`` (what runc's ``--criu`` flag points at) and the same in ``criu_dir/bin/criu``;
- ``criu_dir/bin/iptables``, ``iptables-restore``, ``iptables-save`` and the ``ip6tables`` ones (sid's nft-based
  iptables, for CRIU's network lock of images dumped with one: sbx's own skip it); put ``criu_dir/bin`` first on
  ``PATH`` to use them.

Also the host setup's shared parts: :class:`HostSetupError`, :data:`Progress`, :func:`run_step`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from sbx.config import Settings
from sbx.node.host import aptsources
from sbx.node.host.tools import run_checked
from sbx.node.types import NodeError

Progress = Callable[[str], None]
"""Where a setup step says what it does (one line each; ``print`` in ``sbx setup``)."""

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


def quiet(_msg: str) -> None:
    """A :data:`Progress` that says nothing."""
    return None


def run_step(argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
    """Run ``argv`` (a setup step named ``what``) and return its stdout. Raises :class:`HostSetupError` with its
    output when it fails."""
    return run_checked(argv, what, HostSetupError, env=env).stdout


def _arch() -> str:
    return run_step(["dpkg", "--print-architecture"], "dpkg --print-architecture").strip()


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


def version_tuple(v: str) -> tuple[int, ...]:
    """The numbers of a version for comparing (``"4.2.1-1"`` -> ``(4, 2, 1)``; at most three)."""
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
        return run_step([tool, *self.options(), *args], f"{tool} {' '.join(args)}", env)

    def candidate(self, package: str) -> str | None:
        out = self.run("apt-cache", "policy", package)
        m = re.search(r"Candidate:\s*(\S+)", out)
        return m.group(1) if m and m.group(1) != "(none)" else None


def install_criu(settings: Settings, progress: Progress | None = None) -> str:
    """Install CRIU from Debian sid into ``settings.criu_dir`` unless the wrapper already reports
    :data:`CRIU_VERSION`. Returns the installed version. Raises :class:`HostSetupError` when sid has no CRIU
    at least as new as :data:`CRIU_VERSION`, a download fails, or the unpacked CRIU does not run."""
    say = progress or quiet
    have = installed_criu_version(settings)
    if have == CRIU_VERSION:
        say(f"CRIU {have}: already installed in {settings.criu_dir}")
        return have
    arch = _arch()
    triplet, loader = _loader(arch)
    try:
        mirror = aptsources.debian_mirror()
    except aptsources.NoMirror as e:
        raise HostSetupError(e.message, code=e.code) from e
    criu_dir = settings.criu_dir
    criu_dir.mkdir(parents=True, exist_ok=True)
    apt = _PrivateApt(criu_dir / "apt", mirror)
    apt.prepare()
    say(f"Fetching the Debian {CRIU_SUITE} package index from {mirror}")
    apt.run("apt-get", "update", "-q")
    candidate = apt.candidate("criu")
    if candidate is None or version_tuple(candidate) < version_tuple(CRIU_VERSION):
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
        run_step(["dpkg-deb", "-x", str(deb), str(new_root)], f"dpkg-deb -x {deb.name}")
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
        "# Written by sbx (sbx.node.host.criuinstall): a program from Debian sid, run through sid's own dynamic\n"
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
