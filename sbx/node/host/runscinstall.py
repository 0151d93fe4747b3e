"""gVisor's ``runsc`` for ``sbx setup`` (:mod:`sbx.node.host.setup`): Debian trixie's package, its static binary put
at :data:`RUNSC_PATH`, without touching the host's own packages.

Bookworm's runsc (2022) has only the ptrace platform; trixie's (0.0~20240729) is one static binary that runs on
bookworm with the systrap platform, which works without KVM (runtime-facts). The ordinary ``apt-get`` downloads the
``runsc`` package with the private configuration of :mod:`sbx.node.host.criuinstall` (own sources list on the host's
Debian mirror URI, own state and cache, an empty dpkg status) so no other package of the host is upgraded;
``dpkg-deb -x`` unpacks it and only ``usr/bin/runsc`` is kept.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from sbx.node.host import aptsources
from sbx.node.host.criuinstall import HostSetupError, Progress, _PrivateApt, quiet, run_step
from sbx.node.host.tools import run_checked
from sbx.runtime.runsc import RUNSC_PATH

#: The Debian suite whose runsc sbx uses (its static binary runs on bookworm).
RUNSC_SUITE = "trixie"
#: The package version sbx is tested with (``runsc --version`` says ``0.0~20240729.0``).
RUNSC_VERSION = "0.0~20240729"


class _SuiteApt(_PrivateApt):
    """:class:`sbx.node.host.criuinstall._PrivateApt` on another suite of the same mirror."""

    def __init__(self, base: Path, mirror: str, suite: str):
        super().__init__(base, mirror)
        self.suite = suite

    def prepare(self) -> None:
        """Make the private folders and point its sources list at ``suite``."""
        super().prepare()
        keyring = (self.base / "etc/sources.list").read_text().split("]", 1)[0] + "]"
        (self.base / "etc/sources.list").write_text(f"{keyring} {self.mirror} {self.suite} main\n")


def installed_runsc_version(path: Path = RUNSC_PATH) -> str | None:
    """What ``runsc --version`` reports on its first line (``"0.0~20240729.0"``); None if it can't run."""
    if not os.access(path, os.X_OK):
        return None
    try:
        out = run_checked([str(path), "--version"], "runsc --version", HostSetupError).stdout
    except HostSetupError:
        return None
    m = re.search(r"runsc version (\S+)", out)
    return m.group(1) if m else None


def install_runsc(work_dir: Path, progress: Progress | None = None, target: Path = RUNSC_PATH) -> str:
    """Install trixie's runsc at ``target`` unless a runnable one is there. ``work_dir`` holds the private apt state
    (``<criu_dir>/runsc-apt``). Returns the version runsc reports. Raises :class:`HostSetupError` when the host's
    apt sources name no Debian mirror, trixie has no runsc, the download fails or the binary does not run."""
    say = progress or quiet
    have = installed_runsc_version(target)
    if have is not None:
        say(f"runsc {have}: already installed at {target}")
        return have
    try:
        mirror = aptsources.debian_mirror()
    except aptsources.NoMirror as e:
        raise HostSetupError(e.message, code=e.code) from e
    apt = _SuiteApt(work_dir, mirror, RUNSC_SUITE)
    apt.prepare()
    for stale in apt.archives.glob("*.deb"):  # from an interrupted run
        stale.unlink()
    say(f"Fetching the Debian {RUNSC_SUITE} package index from {mirror}")
    apt.run("apt-get", "update", "-q")
    candidate = apt.candidate("runsc")
    if candidate is None:
        raise HostSetupError(f"Debian {RUNSC_SUITE} offers no runsc package")
    if not candidate.startswith(RUNSC_VERSION):
        say(f"warning: {RUNSC_SUITE} has runsc {candidate}; sbx is tested with {RUNSC_VERSION}")
    say(f"Downloading runsc {candidate} from {RUNSC_SUITE}")
    run_checked(["apt-get", *apt.options(), "download", "-q", f"runsc={candidate}"], "apt-get download runsc",
                HostSetupError, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"), cwd=str(apt.archives))
    debs = sorted(apt.archives.glob("runsc_*.deb"))
    if not debs:
        raise HostSetupError("apt-get downloaded no runsc package")
    unpack = work_dir / "unpack"
    shutil.rmtree(unpack, ignore_errors=True)
    try:
        run_step(["dpkg-deb", "-x", str(debs[0]), str(unpack)], f"dpkg-deb -x {debs[0].name}")
        binary = unpack / "usr/bin/runsc"
        if not binary.is_file():
            raise HostSetupError(f"{debs[0].name} has no usr/bin/runsc")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".new")
        shutil.copyfile(binary, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(unpack, ignore_errors=True)
        for deb in debs:
            deb.unlink(missing_ok=True)
        shutil.rmtree(apt.base / "var/lib/apt/lists", ignore_errors=True)
    version = installed_runsc_version(target)
    if version is None:
        raise HostSetupError(f"the unpacked runsc does not run: {target} --version failed")
    say(f"runsc {version} installed at {target}")
    return version
