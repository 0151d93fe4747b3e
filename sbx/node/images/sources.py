"""Where an image comes from, and its root filesystem unpacked.

Tools, and why: **skopeo** copies any source it knows (``docker-archive:``, ``oci-archive:``, ``oci:`` layouts,
``docker://`` registries) into one OCI image layout, converting docker manifests on the way, so everything after it
reads one format; **umoci** (``umoci raw unpack``) applies that layout's layers to a folder as root (owners, modes,
xattrs and OCI whiteouts kept) without a container store, and ``umoci raw add-layer`` makes a layout of a flat rootfs
tar, so a flat tar goes the same way. buildah could do both but needs a store of its own per use (its stores carry
the uid map of their first use); it is used where it must run steps (:mod:`sbx.node.images.buildah`).

What a source is, told by content, never by name (:func:`detect`): a folder holding ``oci-layout`` and
``index.json`` is an OCI layout; a tar (plain or compressed) holding ``oci-layout`` at its top is an OCI archive, one
holding ``manifest.json`` a ``docker save`` archive, and any other tar with a root filesystem's folders (``etc``,
``bin``, ``usr``, ``lib``) a flat rootfs tar (``docker export``); ``docker://...`` is a registry reference.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sbx.node.images.errors import ImageError

#: The kinds :func:`detect` tells apart.
KINDS = ("oci-layout", "oci-archive", "docker-archive", "rootfs-tar", "registry")
#: The tag the layout's one image is stored under.
TAG = "image"
_ROOT_DIRS = {"etc", "bin", "usr", "lib", "sbin", "var"}
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def detect(source: str | Path) -> str:
    """One of :data:`KINDS` for ``source`` (a path, or a ``docker://`` reference). Raises
    ``ImageError("bad_archive")`` for a missing path, a corrupt or truncated tar, or a tar of none of these kinds."""
    text = str(source)
    if text.startswith("docker://"):
        return "registry"
    path = Path(source)
    if path.is_dir():
        if (path / "oci-layout").is_file() and (path / "index.json").is_file():
            return "oci-layout"
        raise ImageError("bad_archive", f"{path}: a folder but not an OCI image layout (no oci-layout, index.json)")
    if not path.is_file():
        raise ImageError("bad_archive", f"{path}: no such file")
    names: set[str] = set()  # the tar's top-level entries
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                name = member.name[2:] if member.name.startswith("./") else member.name
                names.add(name.strip("/").split("/", 1)[0])
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        raise ImageError("bad_archive", f"{path.name}: not a readable tar archive ({e})") from e
    if {"oci-layout", "index.json"} <= names:
        return "oci-archive"
    if "manifest.json" in names:
        return "docker-archive"
    if names & _ROOT_DIRS:
        return "rootfs-tar"
    raise ImageError("bad_archive", f"{path.name}: a tar, but neither an image archive nor a root filesystem")


def transport(kind: str, source: str | Path) -> str:
    """The skopeo/buildah reference of ``source`` of ``kind`` (``oci-archive:/p``, ``docker-archive:/p``,
    ``oci:/p``, ``docker://...``)."""
    if kind == "registry":
        return str(source)
    if kind == "oci-layout":
        return f"oci:{source}"
    if kind in ("oci-archive", "docker-archive"):
        return f"{kind}:{source}"
    raise ValueError(f"no transport for {kind}")


def _tool(argv: list[str], what: str, code: str = "image_build_failed", tmp: Path | None = None) -> str:
    env = dict(os.environ, TMPDIR=str(tmp)) if tmp else None
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        raise ImageError("image_build_failed", f"{what}: {argv[0]} is not installed (run `sbx setup`)") from e
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-1500:]
        raise ImageError(code, f"{what} failed (exit {proc.returncode}): {tail}")
    return proc.stdout


def to_layout(kind: str, source: str | Path, layout: Path, tmp: Path) -> None:
    """Copy the image at ``source`` (of ``kind``, not ``rootfs-tar``) into the OCI layout ``layout`` under
    :data:`TAG` with ``skopeo copy`` (``tmp``: its scratch, on the data volume). Raises ``ImageError("bad_archive")``
    when skopeo can't read it (``image_build_failed`` for a registry)."""
    code = "image_build_failed" if kind == "registry" else "bad_archive"
    _tool(["skopeo", "copy", "--quiet", transport(kind, source), f"oci:{layout}:{TAG}"], "skopeo copy", code, tmp)


def tar_to_layout(tar: Path, layout: Path) -> None:
    """Make an OCI layout at ``layout`` holding one image (:data:`TAG`) whose one layer is the flat rootfs tar
    ``tar`` (``umoci init`` / ``new`` / ``raw add-layer``). Raises ``ImageError("bad_archive")``."""
    _tool(["umoci", "init", "--layout", str(layout)], "umoci init")
    _tool(["umoci", "new", "--image", f"{layout}:{TAG}"], "umoci new")
    _tool(["umoci", "raw", "add-layer", "--image", f"{layout}:{TAG}", str(tar)], "umoci raw add-layer", "bad_archive")


@dataclass(frozen=True)
class LayoutImage:
    """The image of a layout: ``digest`` (its manifest's, ``sha256:<hex>``), ``config`` (the image config's
    ``config`` object: ``Env``, ``WorkingDir``, ``User``, ...), ``architecture``."""

    digest: str
    config: dict[str, Any]
    architecture: str


def _blob(layout: Path, digest: str) -> dict[str, Any]:
    algo, _, hexd = digest.partition(":")
    return dict(json.loads((layout / "blobs" / algo / hexd).read_text()))


def read_layout(layout: Path) -> LayoutImage:
    """The manifest digest and config of the layout's :data:`TAG` (or only) image. Raises
    ``ImageError("bad_archive")`` when the layout is unreadable and ``ImageError("unsupported_image")`` for an
    architecture other than this host's."""
    try:
        index = json.loads((layout / "index.json").read_text())
        manifests = index.get("manifests") or []
        tagged = [m for m in manifests
                  if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == TAG] or manifests
        if not tagged:
            raise ValueError("the layout holds no image")
        digest = str(tagged[0]["digest"])
        manifest = _blob(layout, digest)
        config = _blob(layout, str(manifest["config"]["digest"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImageError("bad_archive", f"the image's manifest or config is unreadable ({e})") from e
    arch = str(config.get("architecture") or "")
    host = _ARCH.get(platform.machine(), platform.machine())
    if arch and arch != host:
        raise ImageError("unsupported_image", f"the image is for {arch}; this node runs {host}")
    return LayoutImage(digest, dict(config.get("config") or {}), arch)


def unpack(layout: Path, rootfs: Path) -> None:
    """Unpack the layout's image into ``rootfs`` (must not exist) with ``umoci raw unpack`` as root: host owners
    are the image's own (unshifted). Raises ``ImageError("bad_archive")`` when a layer is corrupt."""
    _tool(["umoci", "raw", "unpack", "--image", f"{layout}:{TAG}", str(rootfs)], "umoci raw unpack", "bad_archive")


def archive_layout(layout: Path, out: Path) -> None:
    """Write the layout ``layout`` as an OCI archive (a tar of the layout, what ``oci-archive:`` reads) at ``out``."""
    _tool(["tar", "--numeric-owner", "-C", str(layout), "-cf", str(out), "."], "tar of the OCI layout")
