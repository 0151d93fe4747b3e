"""Base images for the image tests, made from packages these machines reach and cached by what they contain.

Each helper returns the path of an archive in :data:`CACHE` (``/var/cache/sbx-test-bases``), named by a sha256 over
its recipe (kind, suite, packages, the host's mirror lines), made once and reused by every later run:

- :func:`bookworm_oci`: Debian bookworm minbase as an OCI archive (``mmdebstrap --format=tar``, then ``buildah from
  scratch`` / ``add`` / ``config`` / ``commit``): what a docker base image holds, no systemd;
- :func:`trixie_docker`: Debian trixie minbase as a ``docker-archive``, the second family member (Ubuntu's archive is
  not reachable from these machines, so Ubuntu stays untested here);
- :func:`busybox_oci`: busybox-static from Debian's packages with its applets (``sh`` among them) and an honest
  ``/etc/os-release`` (``ID=sbx-busybox``): no systemd, no apt, the minimal init's case;
- :func:`flat_tar`: the bookworm minbase as a flat rootfs tar (what ``docker export`` gives);
- :func:`no_shell_oci`: one static binary (tini) and nothing else: no ``/bin/sh``.

The mirror is the host's (:func:`sbx.node.host.aptsources.mirror_lines`), never named here. Tools missing make the
helper fail, never skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from sbx.node.host.aptsources import debian_mirror, mirror_lines
from sbx.storage.locks import file_lock

CACHE = Path(os.environ.get("SBX_TEST_BASES", "/var/cache/sbx-test-bases"))
#: Bump to remake every cached base.
VERSION = 1
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _run(argv: list[str], **kw: object) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return str(r.stdout)


def _cached(recipe: dict[str, object], suffix: str, make: Callable[[Path, Path], None]) -> Path:
    """The archive of ``recipe`` in :data:`CACHE`; ``make(out, tmpdir)`` writes it when missing (under a lock)."""
    digest = hashlib.sha256(json.dumps({**recipe, "v": VERSION}, sort_keys=True).encode()).hexdigest()[:24]
    out = CACHE / f"{recipe['name']}-{digest}{suffix}"
    if out.exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with file_lock(CACHE / f".{out.name}.lock"):
        if out.exists():
            return out
        with tempfile.TemporaryDirectory(dir=CACHE, prefix=".make-") as tmp:
            part = Path(tmp) / f"part{suffix}"
            make(part, Path(tmp))
            os.replace(part, out)
    return out


def _lines_for(suite: str) -> list[str]:
    """apt source lines for ``suite`` from the host's Debian archive (the bookworm lines as the host lists them)."""
    if suite == "bookworm":
        return mirror_lines()
    return [f"deb {debian_mirror('bookworm')} {suite} main"]


def _minbase_tar(suite: str, out: Path, include: tuple[str, ...] = ()) -> None:
    argv = ["unshare", "--mount", "--propagation", "private", "--", "mmdebstrap", "--mode=root", "--variant=minbase",
            "--format=tar", *([f"--include={','.join(include)}"] if include else []), suite, str(out),
            *_lines_for(suite)]
    _run(argv, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


def _commit(rootfs_tar: Path, dest: str, tmp: Path, env: tuple[str, ...] = (PATH_ENV,),
            cmd: str | None = "/bin/bash") -> None:
    """An image of the flat tar ``rootfs_tar`` committed to ``dest`` (``oci-archive:PATH`` or
    ``docker-archive:PATH:name:tag``) with buildah, in a throwaway store under ``tmp``."""
    store = ["buildah", "--root", str(tmp / "store"), "--runroot", str(tmp / "run"), "--storage-driver", "vfs"]
    ctr = _run([*store, "from", "scratch"]).strip()
    try:
        _run([*store, "add", ctr, str(rootfs_tar), "/"])
        cfg = [a for e in env for a in ("--env", e)]
        if cmd:
            cfg += ["--cmd", cmd]
        _run([*store, "config", *cfg, ctr])
        fmt = "docker" if dest.startswith("docker-archive:") else "oci"
        _run([*store, "commit", "--format", fmt, ctr, dest])
    finally:
        subprocess.run([*store, "rm", "--all"], capture_output=True)
        subprocess.run([*store, "rmi", "--all", "--force"], capture_output=True)


def flat_tar() -> Path:
    """Debian bookworm minbase as a flat rootfs tar (``docker export``'s shape)."""
    recipe = {"name": "bookworm-flat", "suite": "bookworm", "lines": _lines_for("bookworm")}
    return _cached(recipe, ".tar", lambda out, tmp: _minbase_tar("bookworm", out))


def bookworm_oci() -> Path:
    """Debian bookworm minbase as an OCI archive, no systemd (a docker base image's content)."""
    recipe = {"name": "bookworm-oci", "suite": "bookworm", "lines": _lines_for("bookworm")}

    def make(out: Path, tmp: Path) -> None:
        _commit(flat_tar(), f"oci-archive:{out}", tmp)

    return _cached(recipe, ".oci.tar", make)


def trixie_docker() -> Path:
    """Debian trixie minbase as a ``docker save`` archive."""
    recipe = {"name": "trixie-docker", "suite": "trixie", "lines": _lines_for("trixie")}

    def make(out: Path, tmp: Path) -> None:
        rootfs = tmp / "rootfs.tar"
        _minbase_tar("trixie", rootfs)
        _commit(rootfs, f"docker-archive:{out}:sbx-test/trixie:latest", tmp)

    return _cached(recipe, ".docker.tar", make)


OS_RELEASE = 'ID=sbx-busybox\nNAME="sbx test busybox"\nPRETTY_NAME="busybox-static from Debian (sbx test image)"\n'


def busybox_oci() -> Path:
    """busybox-static (Debian's package) with its applets linked under /bin, root's account and an os-release
    saying what it is; no systemd, no apt, no python."""
    recipe = {"name": "busybox-oci", "package": "busybox-static", "lines": _lines_for("bookworm"),
              "os_release": OS_RELEASE}

    def make(out: Path, tmp: Path) -> None:
        debs = tmp / "debs"
        debs.mkdir()
        _run(["apt-get", "download", "busybox-static"], cwd=debs)
        root = tmp / "root"
        for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "tmp", "proc", "sys", "dev", "run"):
            (root / d).mkdir(parents=True, exist_ok=True)
        for deb in debs.glob("*.deb"):
            _run(["dpkg-deb", "-x", str(deb), str(root)])
        _run(["chroot", str(root), "/bin/busybox", "--install", "-s"])
        (root / "tmp").chmod(0o1777)
        (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        (root / "etc/group").write_text("root:x:0:\n")
        (root / "etc/os-release").write_text(OS_RELEASE)
        tar = tmp / "rootfs.tar"
        _run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(tar), "."])
        _commit(tar, f"oci-archive:{out}", tmp, cmd="/bin/sh")
        shutil.rmtree(root)

    return _cached(recipe, ".oci.tar", make)


def no_shell_oci() -> Path:
    """An image holding one static binary (``/tini``, from the host's tini-static) and nothing else."""
    tini = Path("/usr/bin/tini-static")
    recipe = {"name": "noshell-oci", "binary": hashlib.sha256(tini.read_bytes()).hexdigest()}

    def make(out: Path, tmp: Path) -> None:
        root = tmp / "root"
        root.mkdir()
        shutil.copy(tini, root / "tini")
        tar = tmp / "rootfs.tar"
        _run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(tar), "."])
        _commit(tar, f"oci-archive:{out}", tmp, env=(), cmd="/tini")

    return _cached(recipe, ".oci.tar", make)
