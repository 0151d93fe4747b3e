"""The sbx layer every image's root filesystem gets before it becomes a sandbox image.

- An image without ``/bin/sh`` is refused (``image_no_shell``): sbx reaches a sandbox through a shell. Device nodes
  the image carries are removed (a sandbox's ``/dev`` is its own).
- **Debian family** (the image has ``apt-get``): the packages a sandbox relies on that it lacks
  (:data:`PACKAGES`) are installed with ``apt-get`` from the host's mirror for the image's ``VERSION_CODENAME``
  (source lines given to apt for this run only, in the run's own ``/tmp``: the image's own apt sources are left as
  they are), then the default image's customisation (:mod:`sbx.guest.recipe`): guest files, the ``user`` account with
  sudo (an existing ``user``, or another account holding uid 1000, is kept), masked and enabled units, no SSH host
  keys, an empty machine id, plain hostname and resolv.conf, the recipe's text edits where they apply. The image
  config's ``USER`` account, when another, gets passwordless sudo too. Init: systemd.
- **No systemd and no apt** (busybox, musl images): the minimal init (:mod:`sbx.guest.minimal`): a static tini, the
  ``sbx-init`` script, the exec agent (used when the image has python3), a ``user`` account when uid 1000 is free.

Every command runs inside the image as root of a user namespace on the build's uid range
(:mod:`sbx.node.images.guestrun`), never as host root; host-side writes go through
:mod:`sbx.node.container.guestfs`, which never follows the image's symlinks.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from sbx.guest import minimal, recipe
from sbx.node.container import guestfs
from sbx.node.host import aptsources
from sbx.node.images.errors import ImageError
from sbx.node.images.facts import parse_os_release
from sbx.node.images.guestrun import run_inside, shifted_view

Progress = Callable[[str], None]

#: What a systemd sandbox relies on (init, bus, logins, sudo, ssh, the exec agent's python3, the tools the node's
#: commands use), installed when missing.
PACKAGES = ("systemd", "systemd-sysv", "dbus", "libpam-systemd", "sudo", "openssh-server", "python3", "procps",
            "iproute2", "jq", "curl", "ca-certificates", "util-linux", "coreutils")
#: The static tini copied into minimal-init images.
TINI_STATIC = Path("/usr/bin/tini-static")
#: The guest files minimal-init images get (defined in :mod:`sbx.guest.minimal`; this name is kept for callers).
MINIMAL_FILES = minimal.MINIMAL_FILES
@dataclass(frozen=True)
class Layered:
    """What the layer made of the image: ``init`` (``"systemd"`` / ``"minimal"``), ``os_release`` (its
    ``/etc/os-release`` as a dict), ``installed`` (packages it added)."""

    init: str
    os_release: dict[str, str]
    installed: tuple[str, ...]


def resolve(root: Path, path: str, hops: int = 40) -> Path | None:
    """The host path of the image's ``path`` with every symlink resolved inside the image (absolute targets from its
    root, ``..`` never above it); ``None`` when it does not exist. Never follows a link on the host's side."""
    parts = deque(p for p in path.split("/") if p not in ("", "."))
    cur: list[str] = []
    while parts:
        name = parts.popleft()
        if name == "..":
            if cur:
                cur.pop()
            continue
        here = root.joinpath(*cur, name)
        try:
            st = os.lstat(here)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            hops -= 1
            if hops < 0:
                return None
            target = os.readlink(here)
            if target.startswith("/"):
                cur = []
            parts.extendleft(reversed([p for p in target.split("/") if p not in ("", ".")]))
            continue
        if parts and not stat.S_ISDIR(st.st_mode):
            return None
        cur.append(name)
    return root.joinpath(*cur)


def drop_device_nodes(root: Path) -> int:
    """Remove every block and character device node under ``root`` (never following a symlink): a sandbox gets its
    own ``/dev``, and a device node an image carries elsewhere would reach a host device. Returns how many."""
    count = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            try:
                mode = os.lstat(p).st_mode
            except OSError:
                continue
            if stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
                os.unlink(p)
                count += 1
    return count


def has(root: Path, path: str) -> bool:
    """True when the image has ``path`` (a file after its symlinks, resolved inside the image)."""
    found = resolve(root, path)
    return found is not None and found.is_file()


def read_text(root: Path, path: str) -> str:
    """The image's file ``path`` as text (symlinks resolved inside the image); ``""`` when missing."""
    found = resolve(root, path)
    if found is None:
        return ""
    try:
        return guestfs.read_file(root, str(found.relative_to(root))).decode(errors="replace")
    except (OSError, guestfs.UnsafePath):
        return ""


def _install_guest_files(root: Path, files: tuple[recipe.GuestFile, ...]) -> None:
    src = recipe.files_dir()
    try:
        for f in files:
            guestfs.write_file(root, f.dest, (src / f.src).read_bytes(), mode=f.mode)
    except guestfs.UnsafePath as e:
        raise ImageError("unsupported_image", f"the image's folders are symlinks where sbx writes files: {e}") from e


def apply(rootfs: Path, work: Path, uid_base: int, *, network: AbstractContextManager[str] | None,
          sudo_user: str | None, say: Progress, cgroup_path: str | None = None, dns: tuple[str, ...] = ()) -> Layered:
    """Apply the sbx layer to the unpacked ``rootfs`` (module docstring); ``work`` holds the shifted view's mount
    point; commands run on host range ``uid_base``; ``network`` (entered only when packages must be fetched) yields
    the namespace apt reaches the mirror from; ``sudo_user`` is the image config's ``USER`` account; ``cgroup_path``
    the cgroup the commands run in (:func:`sbx.node.images.guestrun.run_inside`); ``dns`` the nameservers apt uses
    there (the node's resolver: :func:`sbx.node.images.buildnet.nameservers`; the image's ``resolv.conf`` is
    replaced while it runs, and emptied after as in every sandbox image). Raises
    ``ImageError`` (``image_no_shell``, ``unsupported_image``, ``build_step_failed`` for a failed install,
    ``image_build_failed``)."""
    if not has(rootfs, "/bin/sh"):
        raise ImageError("image_no_shell", "the image has no /bin/sh: sbx needs a shell in the sandbox")
    dropped = drop_device_nodes(rootfs)
    if dropped:
        say(f"sbx layer: removed {dropped} device node(s) the image carried (a sandbox's /dev is its own)")
    osr = parse_os_release(read_text(rootfs, "/etc/os-release") or read_text(rootfs, "/usr/lib/os-release"))
    apt = has(rootfs, "/usr/bin/apt-get")
    systemd = has(rootfs, "/lib/systemd/systemd") or has(rootfs, "/usr/lib/systemd/systemd")
    with shifted_view(rootfs, work / "view", uid_base) as view:
        if not apt and not systemd:
            say("sbx layer: no systemd and no apt: the minimal init")
            _minimal(rootfs, view, uid_base, cgroup_path)
            return Layered("minimal", osr, ())
        installed: tuple[str, ...] = ()
        if apt:
            if dns:
                try:
                    guestfs.write_file(rootfs, "etc/resolv.conf", "".join(f"nameserver {d}\n" for d in dns).encode())
                except guestfs.UnsafePath as e:
                    raise ImageError("unsupported_image", f"the image's /etc is a symlink: {e}") from e
            installed = _install(view, uid_base, osr, network, say, cgroup_path)
        elif not systemd:
            raise ImageError("unsupported_image", "the image has systemd but no apt")
        say("sbx layer: guest files, the user account, units")
        _customise(rootfs, view, uid_base, sudo_user, cgroup_path)
    return Layered("systemd", osr, installed)


def _sources(osr: dict[str, str]) -> list[str]:
    codename = osr.get("VERSION_CODENAME", "")
    if not codename:
        raise ImageError("unsupported_image", "the image's os-release names no VERSION_CODENAME to install from")
    try:
        archive = aptsources.find_mirror(codename) or (
            aptsources.debian_mirror(recipe.SUITE) if osr.get("ID") == "debian" else None)
    except aptsources.NoMirror as e:
        raise ImageError("unsupported_image", e.message) from e
    if archive is None:
        raise ImageError("unsupported_image", f"the host's apt sources list no archive for {osr.get('ID')} "
                                              f"{codename}, which the image needs packages from")
    lines = [f"{archive} {codename}", f"{archive} {codename}-updates"]
    security = aptsources.find_mirror(recipe.SECURITY_SUITE)
    if security:
        lines.append(f"{security} {codename}-security")
    return [f"{line} main" for line in lines]


_APT = (
    "apt-get -q -o Dir::Etc::SourceList=/tmp/sbx.list -o Dir::Etc::SourceParts=/tmp/sbx.d -o Acquire::Languages=none"
    " -o Acquire::Retries=3"  # a download or lookup that fails for a moment is tried again
)


def _install(view: Path, base: int, osr: dict[str, str], network: AbstractContextManager[str] | None,
             say: Progress, cg: str | None) -> tuple[str, ...]:
    code, out = run_inside(view, base, cgroup_path=cg, script="for p in " + " ".join(PACKAGES) + "; do "
                           "dpkg-query -W -f '${db:Status-Status}' \"$p\" 2>/dev/null | grep -qx installed"
                           " || echo \"$p\"; done")
    if code != 0:
        raise ImageError("image_build_failed", f"dpkg-query in the image failed (exit {code}): {out[-800:]}")
    missing = tuple(out.split())
    if not missing:
        return ()
    lines = _sources(osr)
    say(f"sbx layer: installing {' '.join(missing)} ({osr.get('VERSION_CODENAME')})")
    keyring = ("k=; for f in /usr/share/keyrings/debian-archive-keyring.gpg"
               " /usr/share/keyrings/debian-archive-keyring.pgp; do [ -f \"$f\" ] && k=\"[signed-by=$f] \"; done; ")
    script = (
        "set -e; " + keyring + "mkdir -p /tmp/sbx.d; : > /tmp/sbx.list; "
        + "".join(f"echo \"deb ${{k}}{line}\" >> /tmp/sbx.list; " for line in lines)
        + f"{_APT} update; {_APT} install -y --no-install-recommends " + " ".join(missing) + "; "
        "apt-get clean; rm -rf /var/lib/apt/lists/*"
    )
    with network if network is not None else nullcontext(None) as netns:
        code, out = run_inside(view, base, script, netns=netns, cgroup_path=cg, say=lambda line: say("apt: " + line))
    if code != 0:
        hint = "" if network is not None else " (no network was given for the install)"
        raise ImageError("build_step_failed",
                         f"sbx layer: apt-get install {' '.join(missing)}: exit {code}{hint}\n{out[-1500:]}")
    return missing


def _customise(rootfs: Path, view: Path, base: int, sudo_user: str | None, cg: str | None) -> None:
    _install_guest_files(rootfs, recipe.GUEST_FILES)
    u = recipe.USER
    groups = ",".join(u.groups)
    script = f"""set -e
getent group {u.name} >/dev/null || {{ getent group {u.gid} >/dev/null && groupadd {u.name} || groupadd --gid {u.gid} {u.name}; }}
if ! getent passwd {u.name} >/dev/null; then
  if getent passwd {u.uid} >/dev/null; then idopt=; else idopt="--uid {u.uid}"; fi
  useradd $idopt --gid {u.name} --home-dir {u.home} --create-home --shell {u.shell} {u.name}
fi
for g in {" ".join(u.groups)}; do getent group "$g" >/dev/null || groupadd --system "$g"; done
usermod -a -G {groups} {u.name}
usermod --password '*' {u.name}
systemctl mask {" ".join(recipe.MASKED_UNITS)}
systemctl enable {" ".join(recipe.ENABLED_UNITS)}
systemctl set-default {recipe.DEFAULT_TARGET}
rm -f {" ".join(recipe.REMOVE_GLOBS)}
rm -f /var/cache/apt/archives/*.deb
"""  # noqa: E501
    code, out = run_inside(view, base, script, cgroup_path=cg)
    if code != 0:
        raise ImageError("image_build_failed", f"sbx layer: customising the image failed (exit {code}):\n"
                                               f"{out[-1500:]}")
    if sudo_user and sudo_user != u.name:
        rule = (f"# sbx: the image's USER may run anything as root without a password.\n"
                f"{sudo_user} ALL=(ALL:ALL) NOPASSWD: ALL\n")
        guestfs.write_file(rootfs, f"etc/sudoers.d/sbx-{sudo_user}", rule.encode(), mode=0o440)
    _plain_files(rootfs)


def _plain_files(rootfs: Path) -> None:
    try:
        for path in recipe.EMPTY_FILES:
            guestfs.write_file(rootfs, path, b"", mode=0o444 if path == "/etc/machine-id" else 0o644)
        for path, content in recipe.PLAIN_FILES.items():
            guestfs.write_file(rootfs, path, content.encode(), mode=0o644)
        for path, old, new in recipe.TEXT_EDITS:
            try:
                text = guestfs.read_file(rootfs, path).decode()
            except (OSError, UnicodeDecodeError):
                continue
            if old in text:
                guestfs.write_file(rootfs, path, text.replace(old, new).encode(), mode=0o644)
    except guestfs.UnsafePath as e:
        raise ImageError("unsupported_image", f"the image's folders are symlinks where sbx writes files: {e}") from e


def _minimal(rootfs: Path, view: Path, base: int, cg: str | None) -> None:
    if not TINI_STATIC.is_file():
        raise ImageError("image_build_failed", f"{TINI_STATIC} is missing (package tini; run `sbx setup`)")
    _install_guest_files(rootfs, MINIMAL_FILES)
    guestfs.write_file(rootfs, minimal.MINIMAL_TINI, TINI_STATIC.read_bytes(), mode=0o755)
    u = recipe.USER
    script = f"""cut -d: -f1 /etc/passwd | grep -qx {u.name} && exit 0
cut -d: -f3 /etc/passwd | grep -qx {u.uid} && exit 0
echo '{u.name}:x:{u.uid}:{u.gid}:sbx user:{u.home}:/bin/sh' >> /etc/passwd
cut -d: -f1 /etc/group | grep -qx {u.name} || echo '{u.name}:x:{u.gid}:' >> /etc/group
mkdir -p {u.home} && chown {u.uid}:{u.gid} {u.home}
"""
    code, out = run_inside(view, base, script, cgroup_path=cg)
    if code != 0:
        raise ImageError("image_build_failed", f"sbx layer: adding the user account failed (exit {code}):\n"
                                               f"{out[-800:]}")
    _plain_files(rootfs)
