"""The default sandbox image, described as plain data.

This module is the in-sandbox side of sbx: it says *what* goes into the root filesystem and never touches
the host (no subprocess, no imports from ``sbx.node``/``sbx.runtime``/...). ``sbx.node.host.image`` reads it and
does the work: ``mmdebstrap`` (variant :data:`VARIANT` of Debian :data:`SUITE` with :data:`PACKAGES`),
then the customisation below, then ``mkfs.ext4 -d``.

Customisation, in the order the builder applies it:

1. :data:`GUEST_FILES`: files from ``sbx/guest/files/`` copied to the same path in the rootfs with the given
   mode (unit files, drop-ins, the first-boot identity script, sudoers).
2. :data:`USER`: the login user (uid/gid 1000, passwordless sudo through ``/etc/sudoers.d/user``).
3. :data:`MASKED_UNITS`: units that cannot work inside a container (no udev, no consoles, no host clock, no
   kernel debug filesystems) are masked, so ``systemctl --failed`` stays empty after boot.
4. :data:`ENABLED_UNITS`: ``ssh.service`` and ``sbx-identity.service``; :data:`DEFAULT_TARGET`.
5. :data:`REMOVE_GLOBS` / :data:`EMPTY_FILES` / :data:`PLAIN_FILES`: no SSH host keys in the image (each
   sandbox makes its own), an empty ``/etc/machine-id`` (the host writes a fresh one before boot), and plain
   files for ``/etc/hostname`` and ``/etc/resolv.conf`` (the host overwrites both before boot).
6. :data:`TEXT_EDITS`: small edits of the base's own files (a login shell without a subshell).

:func:`recipe_hash` is a sha256 over all of this plus the bytes and modes of every file in ``files/``; the
image cache is keyed by it, so any change here rebuilds the image.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

#: Bump to force a rebuild when the builder's behaviour changes in a way the data below does not show.
RECIPE_VERSION = 1

#: Debian release and mmdebstrap variant.
SUITE = "bookworm"
VARIANT = "minbase"
COMPONENTS = ("main",)
#: Extra suites used when the host's apt sources list them (updates and security fixes); the main archive URI
#: serves ``<suite>-updates``, the security URI comes from the host entry that lists ``<suite>-security``.
UPDATE_SUITES = (f"{SUITE}-updates",)
SECURITY_SUITE = f"{SUITE}-security"

#: Packages installed on top of the minbase variant (Recommends are not installed).
PACKAGES = (
    # machine: init, bus, logins
    "systemd",
    "systemd-sysv",
    "dbus",
    "libpam-systemd",
    "sudo",
    "openssh-server",
    # tools an agent expects on a Debian machine
    "python3",
    "procps",
    "psmisc",
    "iproute2",
    "iputils-ping",
    "netbase",
    "curl",
    "ca-certificates",
    "jq",
    "less",
    "vim-tiny",
    "git",
    "xz-utils",
    "util-linux",
)

#: dpkg path filters (``mmdebstrap --dpkgopt``): no manuals, translations or docs besides copyright files.
#: They stay in the image (``/etc/dpkg/dpkg.cfg.d``), so packages installed later are trimmed the same way.
DPKG_OPTIONS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/info/*",
)


@dataclass(frozen=True)
class GuestUser:
    """The sandbox's login user: ``name``, numeric ``uid``/``gid``, ``home``, login ``shell`` and
    supplementary ``groups`` (which must exist in the base system)."""

    name: str
    uid: int
    gid: int
    home: str
    shell: str
    groups: tuple[str, ...]


USER = GuestUser(
    name="user",
    uid=1000,
    gid=1000,
    home="/home/user",
    shell="/bin/bash",
    groups=("sudo", "adm", "systemd-journal"),
)


@dataclass(frozen=True)
class GuestFile:
    """One file from ``sbx/guest/files/<src>`` installed at ``dest`` in the rootfs, owned by root, with
    ``mode``."""

    src: str
    dest: str
    mode: int


GUEST_FILES = (
    GuestFile("etc/systemd/system/service.d/10-sbx.conf", "/etc/systemd/system/service.d/10-sbx.conf", 0o644),
    GuestFile("etc/systemd/system/sbx-identity.service", "/etc/systemd/system/sbx-identity.service", 0o644),
    GuestFile(
        "etc/systemd/system/ssh.service.d/10-sbx-hostkeys.conf",
        "/etc/systemd/system/ssh.service.d/10-sbx-hostkeys.conf",
        0o644,
    ),
    GuestFile("etc/systemd/journald.conf.d/10-sbx.conf", "/etc/systemd/journald.conf.d/10-sbx.conf", 0o644),
    GuestFile("usr/lib/sbx/sbx-identity", "/usr/lib/sbx/sbx-identity", 0o755),
    GuestFile("etc/systemd/system/sbx-agent.service", "/etc/systemd/system/sbx-agent.service", 0o644),
    GuestFile("usr/lib/sbx/sbx-agent", "/usr/lib/sbx/sbx-agent", 0o755),
    GuestFile("etc/sudoers.d/user", "/etc/sudoers.d/user", 0o440),
    GuestFile("etc/sbx/README", "/etc/sbx/README", 0o644),
    GuestFile("etc/hosts", "/etc/hosts", 0o644),
    GuestFile("etc/default/locale", "/etc/default/locale", 0o644),
)

#: Units masked (linked to /dev/null). Each one fails or makes no sense in a container:
MASKED_UNITS = (
    # consoles: a sandbox has no tty1/serial line; `sbx exec` and ssh are the way in
    "getty@tty1.service",
    "console-getty.service",
    "serial-getty@.service",
    "getty-static.service",
    # udev: no device management inside a container (/sys is read-only)
    "systemd-udevd.service",
    "systemd-udevd-control.socket",
    "systemd-udevd-kernel.socket",
    "systemd-udev-trigger.service",
    "systemd-udev-settle.service",
    # the host does networking, DNS and the clock
    "systemd-networkd.service",
    "systemd-networkd.socket",
    "systemd-networkd-wait-online.service",
    "systemd-resolved.service",
    "systemd-timesyncd.service",
    # kernel filesystems a container may not mount
    "sys-kernel-debug.mount",
    "sys-kernel-tracing.mount",
    "sys-fs-fuse-connections.mount",
    "dev-hugepages.mount",
    "sys-kernel-config.mount",
    "proc-sys-fs-binfmt_misc.automount",
    "proc-sys-fs-binfmt_misc.mount",
    "systemd-binfmt.service",
    # host-only jobs: kernel modules, sysctl, swap, hardware clock, fs checks and trimming of the disk
    "systemd-modules-load.service",
    "kmod-static-nodes.service",
    "systemd-sysctl.service",
    "systemd-remount-fs.service",
    "systemd-pstore.service",
    "systemd-hwdb-update.service",
    "e2scrub_all.timer",
    "e2scrub_reap.service",
    "fstrim.timer",
    # background package downloads would change a sandbox behind the user's back
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
)

#: Units enabled in the image.
ENABLED_UNITS = ("ssh.service", "sbx-identity.service", "sbx-agent.service")

#: The boot target (a sandbox has no graphical session).
DEFAULT_TARGET = "multi-user.target"

#: Globs removed from the rootfs after installation.
REMOVE_GLOBS = ("/etc/ssh/ssh_host_*",)

#: Files left present but empty: systemd must not keep the base's machine id; the host writes one before boot.
EMPTY_FILES = ("/etc/machine-id",)

#: Plain files written with this content (replacing any symlink). The host rewrites them before every boot.
PLAIN_FILES = {
    "/etc/hostname": "sandbox\n",
    "/etc/resolv.conf": "",
}


#: Text replaced in files of the installed base (path, old, new; every occurrence; a missing ``old`` fails the
#: build). Debian's ``/etc/profile`` (copied by base-files only when missing, so no package upgrade rewrites
#: it) runs ``id -u`` in a subshell twice for every login shell; each ``sbx exec`` is one (``bash -lc``), and the
#: fork and exec of ``id`` were about 1 ms of a 3 ms command. bash knows its ``EUID``; a POSIX sh still runs ``id``.
TEXT_EDITS = (
    ("/etc/profile", "$(id -u)", "${EUID:-$(id -u)}"),
)


def files_dir() -> Path:
    """The folder holding the guest files (``sbx/guest/files``)."""
    return Path(__file__).resolve().parent / "files"


#: The root filesystem's format (``mkfs.ext4`` options). Given explicitly because mke2fs would pick its "small"
#: profile for an image this size (1 KiB blocks, one inode per 4 KiB), which resize2fs keeps when a sandbox's
#: disk grows to tens of GiB: 5-6 % of the disk would go to inode tables.
FILESYSTEM = {"label": "sbx-root", "block_size": 4096, "bytes_per_inode": 16384, "inode_size": 256}


def recipe_data() -> dict[str, object]:
    """Everything the image depends on besides the guest files' bytes, as JSON-ready data."""
    return {
        "version": RECIPE_VERSION,
        "suite": SUITE,
        "variant": VARIANT,
        "components": list(COMPONENTS),
        "update_suites": list(UPDATE_SUITES),
        "security_suite": SECURITY_SUITE,
        "packages": list(PACKAGES),
        "dpkg_options": list(DPKG_OPTIONS),
        "user": asdict(USER),
        "guest_files": [asdict(f) for f in GUEST_FILES],
        "masked_units": list(MASKED_UNITS),
        "enabled_units": list(ENABLED_UNITS),
        "default_target": DEFAULT_TARGET,
        "remove_globs": list(REMOVE_GLOBS),
        "empty_files": list(EMPTY_FILES),
        "plain_files": dict(PLAIN_FILES),
        "text_edits": [list(e) for e in TEXT_EDITS],
        "filesystem": dict(FILESYSTEM),
    }


def recipe_hash(root: Path | None = None) -> str:
    """sha256 (64 hex chars) over :func:`recipe_data` and every file under ``root`` (default
    :func:`files_dir`): its relative path, whether it is executable, and its bytes. The image cache file is
    named after it, so changing the recipe or any guest file gives a new image."""
    base = root if root is not None else files_dir()
    h = hashlib.sha256()
    h.update(json.dumps(recipe_data(), sort_keys=True).encode())
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        rel = path.relative_to(base).as_posix()
        executable = bool(path.stat().st_mode & 0o111)
        h.update(b"\0file\0" + rel.encode() + (b"\0x\0" if executable else b"\0-\0"))
        data = path.read_bytes()
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()
