"""Commands of an image run inside its root filesystem, never as host root: the sbx layer's package installs and
account changes execute the image's own programs (``apt-get``, ``useradd``, maintainer scripts), which a hostile
Dockerfile may have replaced.

:func:`shifted_view` mounts an idmapped view of the unpacked rootfs (owner ``u`` on disk shows as ``base + u``,
:func:`sbx.storage.idmap.idmapped_bind`); :func:`run_inside` runs a shell command chrooted into that view as root of a
user namespace mapping 0..65535 to ``base..`` (:mod:`sbx.node.images.usernsexec`), in mount and pid namespaces of its
own (a small ``/dev``, ``/proc``, tmpfs ``/run`` and ``/tmp``; nothing of them stays in the image), and in the build's
network namespace when given (else in an empty one). What it writes lands on disk with the image's own owners.
Escaping the chroot leaves it a host uid of the build's range with no capability outside its namespaces.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sbx.node.container import cgroup
from sbx.node.images import usernsexec
from sbx.node.images.errors import ImageError
from sbx.storage import idmap
from sbx.storage.errors import StorageError

#: Memory cap of the commands (bytes).
MEMORY = 4 << 30
#: The environment commands inside get (nothing of the host's).
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LC_ALL": "C",
    "DEBIAN_FRONTEND": "noninteractive",
}

# Run by the host's /bin/sh as root of the new user namespace, in its fresh mount and pid namespaces: the mounts the
# image's programs need, then chroot. $1: the view; the rest: the command.
_SETUP = """v=$1; shift
mount -t tmpfs -o mode=755,size=16m,nosuid tmpfs "$v/dev" || exit 125
for d in null zero full random urandom tty; do : > "$v/dev/$d" && mount --bind "/dev/$d" "$v/dev/$d" || exit 125; done
ln -s /proc/self/fd "$v/dev/fd"
mount -t proc -o nosuid,nodev,noexec proc "$v/proc" || exit 125
mount -t tmpfs -o mode=755,nosuid,nodev tmpfs "$v/run" || exit 125
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$v/tmp" || exit 125
exec chroot "$v" "$@"
"""


@contextmanager
def shifted_view(rootfs: Path, view: Path, base: int) -> Iterator[Path]:
    """Mount ``rootfs``'s idmapped view (shifted by ``base``) at ``view`` for the block; unmounted after (lazily if
    busy). Raises ``ImageError("image_build_failed")`` when the kernel refuses it."""
    try:
        idmap.idmapped_bind(rootfs, view, base)
    except StorageError as e:
        raise ImageError("image_build_failed", f"shifted view of the image: {e}") from e
    try:
        yield view
    finally:
        try:
            idmap.unmount(view)
        except StorageError:
            subprocess.run(["umount", "-l", str(view)], capture_output=True, check=False)


def run_inside(view: Path, base: int, script: str, *, netns: str | None = None, timeout: float = 1800,
               cgroup_path: str | None = None, say: Callable[[str], None] | None = None) -> tuple[int, str]:
    """Run ``script`` with the image's ``/bin/sh -c`` chrooted into ``view`` (a :func:`shifted_view` of ``base``),
    as root of a user namespace on ``base``, in network namespace ``netns`` (a path) or an empty one. ``say`` gets
    each output line. With ``cgroup_path`` (``/sbx/<node>/layer-<id>``) the command runs in that cgroup (memory
    capped at :data:`MEMORY`, below the node's own memory and pids limits; killed and removed after). Returns ``(exit
    status, last 60 lines of output)``; after ``timeout`` seconds the command is killed (status -9)."""
    inner = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private",
             *([] if netns else ["--net"]), "--", "/bin/sh", "-c", _SETUP, "sbx-setup", str(view),
             "/bin/sh", "-c", script]
    dirs = _make_cgroup(cgroup_path) if cgroup_path else []
    argv = [sys.executable, usernsexec.__file__, str(base), *dirs, "--", *inner]
    if netns:
        argv = ["nsenter", f"--net={netns}", "--", *argv]
    tail: deque[str] = deque(maxlen=60)
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=ENV, text=True, errors="replace")
    assert proc.stdout is not None
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if say:
                say(line)
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if cgroup_path:
            cgroup.kill_all(cgroup_path)
            cgroup.remove_tree(cgroup_path)
    return code, "\n".join(tail)


def _make_cgroup(path: str) -> list[str]:
    """The cgroup v1 directories of ``path`` under the memory and pids hierarchies, made, the memory one capped at
    :data:`MEMORY`."""
    dirs = []
    for ctrl in ("memory", "pids"):
        d = cgroup.CGROUP_ROOT / ctrl / path.lstrip("/")
        if not (cgroup.CGROUP_ROOT / ctrl).is_dir():
            continue
        d.mkdir(parents=True, exist_ok=True)
        if ctrl == "memory":
            (d / "memory.limit_in_bytes").write_text(str(MEMORY))
        dirs.append(str(d))
    return dirs
