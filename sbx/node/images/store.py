"""The node's image library: sandbox base images made from an archive or a Dockerfile, kept on the data volume.

Files, all in ``settings.images_dir`` (beside the default image, :mod:`sbx.node.host.image`):

- ``<key>.ext4``: the sparse ext4 root filesystem a sandbox of the image boots (``mkfs.ext4 -d`` with the default
  image's :data:`sbx.guest.recipe.FILESYSTEM`);
- ``<key>.json``: its :class:`~sbx.node.images.facts.ImageFacts`;
- ``<key>.oci.tar``: the source image as an OCI archive (before the sbx layer), for a later Dockerfile's ``FROM``
  (:func:`base_archive`);
- ``<key>.lock``: the build's ``flock`` (two builds of one key share one); ``<key>.inuse``: a running node's hold
  (:func:`sbx.node.host.image.hold_image`).
- ``.work/<build>/``: a build's scratch (buildah store, OCI layout, rootfs); removed when the build ends, however it
  ends. ``.builds/<input hash>``: the key a Dockerfile build's inputs gave (the cache of builds).

The key is a sha256 over the source image's digest (the manifest's, or a flat tar's own sha256), the recipe hash
(:func:`sbx.guest.recipe.recipe_hash`) and :data:`LAYER_VERSION`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from sbx.config import Settings
from sbx.guest import recipe
from sbx.node.host.image import IN_USE_SUFFIX
from sbx.node.images.errors import ImageError
from sbx.node.images.facts import ImageFacts
from sbx.storage.locks import file_lock

__all__ = ["ImageError", "ImageFacts", "base_archive", "build_dockerfile", "delete_image", "image_file",
           "image_key", "import_archive", "load_facts"]

Progress = Callable[[str], None]

#: Bump when the sbx layer (:mod:`sbx.node.images.layer`) changes in a way the recipe hash does not show.
LAYER_VERSION = 1


def image_key(source_digest: str) -> str:
    """The key (64 hex chars) of the image made from a source whose digest is ``source_digest``
    (``sha256:<hex>``): sha256 over it, the recipe hash and :data:`LAYER_VERSION`."""
    h = hashlib.sha256()
    h.update(f"sbx-image\0{source_digest}\0{recipe.recipe_hash()}\0{LAYER_VERSION}".encode())
    return h.hexdigest()


def image_file(settings: Settings, key: str) -> Path:
    """The image's ext4 file: ``settings.images_dir / f"{key}.ext4"`` (no existence check)."""
    return settings.images_dir / f"{key}.ext4"


def facts_file(settings: Settings, key: str) -> Path:
    """The image's facts: ``settings.images_dir / f"{key}.json"`` (no existence check)."""
    return settings.images_dir / f"{key}.json"


def base_archive(settings: Settings, key: str) -> Path:
    """The image's source as an OCI archive (``<key>.oci.tar``), for a Dockerfile's ``FROM`` (``bases``).
    Raises ``ImageError("image_not_found")`` when the image or its archive is missing."""
    load_facts(settings, key)
    path = settings.images_dir / f"{key}.oci.tar"
    if not path.is_file():
        raise ImageError("image_not_found", f"image {key} keeps no source archive")
    return path


def load_facts(settings: Settings, key: str) -> ImageFacts:
    """The facts of image ``key``. Raises ``ImageError("image_not_found")`` when its ``.ext4`` or ``.json`` is
    missing or the key is malformed."""
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ImageError("image_not_found", f"no image {key!r} (a key is 64 hex chars)")
    path = facts_file(settings, key)
    if not path.is_file() or not image_file(settings, key).is_file():
        raise ImageError("image_not_found", f"no image {key} on this node")
    try:
        return ImageFacts.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImageError("image_not_found", f"image {key}: unreadable facts ({e})") from e


def delete_image(settings: Settings, key: str) -> None:
    """Remove image ``key`` (``.ext4``, ``.json``, ``.oci.tar`` and its lock files). Refused with
    ``ImageError("image_in_use")`` while a running node holds it (:func:`sbx.node.host.image.hold_image`) or a build
    of it runs; ``ImageError("image_not_found")`` when there is no such image."""
    load_facts(settings, key)
    target = image_file(settings, key)
    in_use = target.with_suffix(IN_USE_SUFFIX)
    with file_lock(target.with_suffix(".lock"), wait=False) as free:
        if not free:
            raise ImageError("image_in_use", f"image {key} is being built")
        if in_use.exists():
            with file_lock(in_use, wait=False) as unused:
                if not unused:
                    raise ImageError("image_in_use", f"image {key} is in use by a running node")
                _remove(settings, key)
        else:
            _remove(settings, key)


def _remove(settings: Settings, key: str) -> None:
    d = settings.images_dir
    for name in (f"{key}.json", f"{key}.ext4", f"{key}.oci.tar", f"{key}.inuse", f"{key}.lock"):
        (d / name).unlink(missing_ok=True)


def import_archive(settings: Settings, archive: Path, progress: Progress | None = None, *,
                   network: AbstractContextManager[str] | None = None, uid_base: int | None = None) -> ImageFacts:
    """Make a sandbox image of ``archive``: a ``docker save`` archive, an OCI archive, an OCI layout directory, a
    flat rootfs tar (``docker export``), or a ``docker://`` reference; which one is told by its content.
    ``progress`` gets one-line messages. ``network`` (a context manager yielding a network namespace path) and
    ``uid_base`` (a reserved host uid range) are those of the sbx layer's package installs; without them the library
    reserves a range itself and installs without network. Returns the image's facts (at once when it exists).
    Raises :class:`ImageError` (``bad_archive``, ``image_no_shell``, ``unsupported_image``,
    ``image_build_failed``)."""
    raise ImageError("image_build_failed", "not implemented yet")


def build_dockerfile(settings: Settings, dockerfile: Path, context: Path, progress: Progress | None = None, *,
                     network: AbstractContextManager[str] | None = None, uid_base: int | None = None,
                     bases: dict[str, Path] | None = None) -> ImageFacts:
    """Build ``dockerfile`` with ``context`` (a folder) by ``buildah bud`` and make a sandbox image of the result.
    ``bases`` maps image names a ``FROM`` may use to archives (OCI or docker). ``network`` yields the RUN steps'
    network namespace (none without); ``uid_base`` is the reserved host uid range RUN steps run as (the library
    reserves one without it). ``progress`` gets buildah's output lines. A build whose inputs (Dockerfile bytes, the
    context's files and modes, the bases' digests) were built before returns its facts at once. Raises
    :class:`ImageError` (``bad_dockerfile``, ``build_step_failed``, ``copy_source_missing``, ``image_no_shell``,
    ``unsupported_image``, ``image_build_failed``); a failed build leaves nothing behind."""
    raise ImageError("image_build_failed", "not implemented yet")
