"""sbx's own Debian image as a Dockerfile base: ``FROM sbx-debian``.

A team's Dockerfile usually starts from a distribution image, which these hosts may have no registry to pull from.
``FROM sbx-debian`` names the default sandbox image (:mod:`sbx.node.host.image`: Debian 12 with systemd, sudo, sshd,
python3, git, curl, the host's Debian mirror in its apt sources). The node turns its ext4 file into an OCI archive
once per recipe, ``<images_dir>/<recipe hash>.base.oci.tar`` (pruned with that image): the filesystem mounted
read-only in a mount namespace of its own, tarred with numeric owners, committed by ``buildah`` from ``scratch`` in
a throwaway store. The build then uses it as any named base. About 15 s the first time, nothing after.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from sbx.config import Settings
from sbx.node.images.errors import ImageError
from sbx.storage.locks import file_lock

#: The name a Dockerfile's ``FROM`` uses for sbx's default image.
NAME = "sbx-debian"
_FROM = re.compile(rf"^\s*FROM\s+(--\S+\s+)*{re.escape(NAME)}(\s|$)", re.IGNORECASE | re.MULTILINE)
#: Suffix of the default image's OCI archive beside its ``.ext4``.
BASE_SUFFIX = ".base.oci.tar"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def wanted(dockerfile_text: str) -> bool:
    """Whether a ``FROM`` line of the Dockerfile names :data:`NAME`."""
    return bool(_FROM.search(dockerfile_text))


def default_base_archive(settings: Settings, image: Path) -> Path:
    """The OCI archive of the default image ``image`` (its ``.ext4``), made on first use (module docstring).
    Concurrent callers share one conversion. Raises ``ImageError("image_build_failed")``."""
    out = image.with_suffix(BASE_SUFFIX)
    if out.is_file():
        return out
    locks = settings.images_dir / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with file_lock(locks / f"{image.stem}.base.lock"):
        if out.is_file():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=settings.images_dir))
        try:
            (tmp / "mnt").mkdir()
            _run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec",
                  'mount -o ro,loop,noload "$1" "$2"; tar --numeric-owner --xattrs -C "$2" -cf "$3" .', "sh",
                  str(image), str(tmp / "mnt"), str(tmp / "rootfs.tar")], "reading the default image")
            store = ["buildah", "--root", str(tmp / "store"), "--runroot", str(tmp / "run"), "--storage-driver", "vfs"]
            ctr = _run([*store, "from", "scratch"], "buildah from").strip()
            _run([*store, "add", ctr, str(tmp / "rootfs.tar"), "/"], "buildah add")
            _run([*store, "config", "--env", PATH_ENV, "--cmd", "/bin/bash", ctr], "buildah config")
            _run([*store, "commit", "--format", "oci", ctr, f"oci-archive:{tmp / 'base.tar'}"], "buildah commit")
            (tmp / "base.tar").replace(out)
        finally:
            subprocess.run(["buildah", "--root", str(tmp / "store"), "--runroot", str(tmp / "run"),
                            "--storage-driver", "vfs", "rm", "--all"], capture_output=True, check=False)
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _run(argv: list[str], what: str) -> str:
    p = subprocess.run(argv, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise ImageError("image_build_failed", f"{NAME}: {what} failed: {(p.stderr or p.stdout).strip()[-600:]}")
    return p.stdout
