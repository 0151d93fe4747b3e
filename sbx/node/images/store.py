"""The node's image library: sandbox base images made from an archive or a Dockerfile, kept on the data volume.

Files, all in ``settings.images_dir`` (beside the default image, :mod:`sbx.node.host.image`):

- ``<key>.ext4``: the sparse ext4 root filesystem a sandbox of the image boots (``mkfs.ext4 -d`` with the default
  image's :data:`sbx.guest.recipe.FILESYSTEM`);
- ``<key>.json``: its :class:`~sbx.node.images.facts.ImageFacts`;
- ``<key>.oci.tar``: the source image as an OCI archive (before the sbx layer), for a later Dockerfile's ``FROM``
  (:func:`base_archive`);
- ``<key>.inuse``: a running node's hold (:func:`sbx.node.host.image.hold_image`);
- ``.locks/<key>.lock``, ``.locks/build-<input hash>.lock``: the ``flock`` files that make two builds of one image
  (or of one Dockerfile's inputs) share one (empty files, kept: removing a lock file races its next holder);
- ``.work/<build>/``: a build's scratch (buildah store, OCI layout, rootfs); removed when the build ends, however it
  ends. ``.builds/<input hash>``: the key a Dockerfile build's inputs gave (the cache of builds).

The key is a sha256 over the source image's digest (the manifest's, or a flat tar's own sha256), the recipe hash
(:func:`sbx.guest.recipe.recipe_hash`) and :data:`LAYER_VERSION`.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from sbx.config import Settings
from sbx.guest import recipe
from sbx.node.host import mirrors
from sbx.node.host.image import IN_USE_SUFFIX, detach_mounts, fsync_dir, write_ext4
from sbx.node.images import buildah, layer, sources
from sbx.node.images import dockerfile as dockerfiles
from sbx.node.images.buildnet import nameservers
from sbx.node.images.errors import ImageError
from sbx.node.images.facts import ImageFacts, parse_env, parse_passwd, user_name, users_of, workdir_of
from sbx.node.images.reserve import claim
from sbx.node.types import NodeError
from sbx.storage.locks import file_lock

__all__ = ["ImageError", "ImageFacts", "base_archive", "build_dockerfile", "delete_image", "image_file",
           "image_key", "import_archive", "load_facts"]

Progress = Callable[[str], None]

#: Bump when the sbx layer (:mod:`sbx.node.images.layer`) changes in a way the recipe hash does not show.
LAYER_VERSION = 2


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
    with file_lock(_lock(settings, key), wait=False) as free:
        if not free:
            raise ImageError("image_in_use", f"image {key} is being built")
        if in_use.exists():
            with file_lock(in_use, wait=False) as unused:
                if not unused:
                    raise ImageError("image_in_use", f"image {key} is in use by a running node")
                _remove(settings, key)
        else:
            _remove(settings, key)


def _lock(settings: Settings, name: str) -> Path:
    return settings.images_dir / ".locks" / f"{name}.lock"


def _remove(settings: Settings, key: str) -> None:
    d = settings.images_dir
    for name in (f"{key}.json", f"{key}.ext4", f"{key}.oci.tar", f"{key}.inuse"):
        (d / name).unlink(missing_ok=True)
    for record in (d / ".builds").glob("*"):  # the cached builds that gave this image
        try:
            if record.read_text().strip() == key:
                record.unlink()
        except OSError:
            continue


def import_archive(settings: Settings, archive: Path | str, progress: Progress | None = None, *,
                   network: AbstractContextManager[str] | None = None, uid_base: int | None = None) -> ImageFacts:
    """Make a sandbox image of ``archive``: a ``docker save`` archive, an OCI archive, an OCI layout directory, a
    flat rootfs tar (``docker export``), or a ``docker://`` reference (a ``str``: a ``Path`` would fold its ``//``);
    which one is told by its content
    (:func:`sbx.node.images.sources.detect`). ``progress`` gets one-line messages. ``network`` (a context manager
    yielding a network namespace path, entered only when the sbx layer must fetch packages) and ``uid_base`` (a
    reserved host uid range the sbx layer's commands run as) come from the node (:class:`ImagesMixin`); without
    ``uid_base`` the library claims a range itself, without ``network`` packages can't be fetched. Returns the
    image's facts (at once when the image exists). Raises :class:`ImageError` (``bad_archive``, ``image_no_shell``,
    ``unsupported_image``, ``build_step_failed`` for a failed package install, ``image_build_failed``)."""
    say = progress or (lambda _m: None)
    start = time.monotonic()
    kind = sources.detect(archive)
    say(f"source: {kind}")
    source = "registry" if kind == "registry" else "archive"
    with _work(settings) as work:
        layout = work / "layout"
        if kind == "rootfs-tar":
            digest = dockerfiles.file_digest(Path(archive))
            key = image_key(digest)
            if _exists(settings, key):
                return load_facts(settings, key)
            sources.tar_to_layout(Path(archive), layout)
        else:
            sources.to_layout(kind, archive, layout, work)
            key = image_key(sources.read_layout(layout).digest)
        return _finish(settings, key, work, network, uid_base, say, source, start)


def build_dockerfile(settings: Settings, dockerfile: Path, context: Path, progress: Progress | None = None,
                     *, network: AbstractContextManager[str] | None = None, uid_base: int | None = None,
                     bases: dict[str, Path] | None = None) -> ImageFacts:
    """Build ``dockerfile`` with ``context`` (a folder) by ``buildah bud`` (:mod:`sbx.node.images.buildah`) and
    make a sandbox image of the result as :func:`import_archive` does. ``bases`` maps image names a ``FROM`` may use
    to archives (OCI or docker; :func:`base_archive` of an image built before); ``FROM oci-archive:/path`` and
    ``docker-archive:/path`` work as well. ``network`` yields the network namespace RUN steps run in (none without
    it); ``uid_base`` is the reserved host uid range they run as (the library claims one without it). ``progress``
    gets buildah's output lines. A build whose inputs (the Dockerfile, the context's files and modes, the bases'
    digests) were built before returns its facts at once (``cached build``). Raises :class:`ImageError`
    (``bad_dockerfile``, ``build_step_failed``, ``copy_source_missing``, ``bad_archive``, ``image_no_shell``,
    ``unsupported_image``, ``image_build_failed``); a failed build leaves nothing behind."""
    say = progress or (lambda _m: None)
    start = time.monotonic()
    try:
        text = dockerfile.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ImageError("bad_dockerfile", f"{dockerfile}: {e}") from e
    if not context.is_dir():
        raise ImageError("copy_source_missing", f"the build context {context} is not a folder")
    named = dict(bases or {})
    kinds = {}
    for path in named.values():
        kind = sources.detect(path)
        if kind not in ("oci-archive", "docker-archive"):
            raise ImageError("bad_archive", f"base {path}: a {kind}, not an OCI or docker archive")
        kinds[path] = kind
    resolved, used = dockerfiles.resolve_bases(text, named, kinds)
    for path in used:
        if not path.is_file():
            raise ImageError("bad_archive", f"FROM {path}: no such archive")
    digests = [dockerfiles.file_digest(p) for p in used]
    inputs = dockerfiles.input_hash(resolved, context, digests)
    builds = settings.images_dir / ".builds"
    builds.mkdir(parents=True, exist_ok=True)
    with file_lock(_lock(settings, f"build-{inputs}")):
        key = _built(settings, builds / inputs)
        if key:
            say(f"cached build: image {key[:12]}")
            return load_facts(settings, key)
        with _work(settings) as work:
            with _claimed(settings, uid_base) as base:
                (work / "Dockerfile").write_text(resolved)
                with _entered(network) as netns:  # entered once: RUN steps, then the sbx layer's installs
                    buildah.bud(work, work / "Dockerfile", context, base, netns, nameservers(settings) if netns else [],
                                f"/sbx/{settings.node_name}/build-{work.name}", say,
                                ca_file=_ca_file(settings), build_args=mirrors.build_args())
                    layout = work / "layout"
                    buildah.push(work, layout, sources.TAG)
                    buildah.clean(work)
                    shutil.rmtree(work / "store", ignore_errors=True)
                    key = image_key(sources.read_layout(layout).digest)
                    again = nullcontext(netns) if netns is not None else None
                    facts = _finish(settings, key, work, again, base, say, "dockerfile", start)
        tmp = builds / f".{inputs}.tmp"
        tmp.write_text(key + "\n")
        os.replace(tmp, builds / inputs)
        return facts


def _built(settings: Settings, record: Path) -> str | None:
    """The key a build record names when that image is still there."""
    try:
        key = record.read_text().strip()
    except OSError:
        return None
    return key if _exists(settings, key) else None


def _exists(settings: Settings, key: str) -> bool:
    return image_file(settings, key).is_file() and facts_file(settings, key).is_file()


@contextmanager
def _entered(cm: AbstractContextManager[str] | None) -> Iterator[str | None]:
    if cm is None:
        yield None
        return
    with cm as value:
        yield value


@contextmanager
def _claimed(settings: Settings, uid_base: int | None) -> Iterator[int]:
    """``uid_base`` when the caller reserved one, else a range claimed for the block (:func:`reserve.claim`)."""
    if uid_base is not None:
        yield uid_base
        return
    with claim(settings) as c:
        yield c.uid_base


@contextmanager
def _work(settings: Settings) -> Iterator[Path]:
    """A scratch folder ``images_dir/.work/<random>`` on the data volume, removed (mounts detached first) however
    the block ends; folders of builds whose process died are removed too."""
    root = settings.images_dir / ".work"
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)  # the sbx layer's commands (a shifted uid) must reach their view below it
    for stale in root.iterdir():
        pid = stale.name.split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            detach_mounts(stale)
            shutil.rmtree(stale, ignore_errors=True)
    work = root / f"{os.getpid()}-{secrets.token_hex(6)}"
    work.mkdir(mode=0o711)
    try:
        yield work
    finally:
        detach_mounts(work)
        if (work / "store").exists():
            buildah.clean(work)
        shutil.rmtree(work, ignore_errors=True)


def _finish(settings: Settings, key: str, work: Path, network: AbstractContextManager[str] | None,
            uid_base: int | None, say: Progress, source: str, start: float) -> ImageFacts:
    """From the OCI layout ``work/layout`` to image ``key``: unpack, the sbx layer, ext4, facts, the source kept as
    ``<key>.oci.tar``; under the key's lock, at once when it exists."""
    with file_lock(_lock(settings, key)):
        if _exists(settings, key):
            say(f"image {key[:12]} exists")
            return load_facts(settings, key)
        layout, rootfs = work / "layout", work / "rootfs"
        info = sources.read_layout(layout)
        say("unpacking the image")
        sources.unpack(layout, rootfs)
        passwd = parse_passwd(layer.read_text(rootfs, "/etc/passwd"))
        try:
            wanted = user_name(str(info.config.get("User") or ""), passwd)
        except ValueError as e:
            raise ImageError("unsupported_image", str(e)) from e
        with _claimed(settings, uid_base) as base:
            layered = layer.apply(rootfs, work, base, network=network, sudo_user=wanted, say=say,
                                  cgroup_path=f"/sbx/{settings.node_name}/layer-{work.name}",
                                  dns=tuple(nameservers(settings)))
        final = parse_passwd(layer.read_text(rootfs, "/etc/passwd"))
        shell = "/bin/bash" if layer.has(rootfs, "/bin/bash") else "/bin/sh"
        out = work / "image.ext4"
        say("writing the ext4 image")
        try:
            content, size = write_ext4(rootfs, out)
        except NodeError as e:
            raise ImageError("image_build_failed", e.message) from e
        shutil.rmtree(rootfs, ignore_errors=True)
        sources.archive_layout(layout, work / "source.oci.tar")
        facts = ImageFacts(
            key=key, os_id=layered.os_release.get("ID", ""), os_name=layered.os_release.get("PRETTY_NAME", ""),
            init=layered.init, shell=shell,
            env=parse_env(info.config.get("Env")), workdir=workdir_of(info.config), user=wanted,
            users=users_of(final, wanted), content_bytes=content, size_bytes=size, source=source,
            built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            build_seconds=round(time.monotonic() - start, 1))
        (work / "facts.json").write_text(json.dumps(facts.to_json(), indent=2) + "\n")
        d = settings.images_dir
        os.replace(work / "source.oci.tar", d / f"{key}.oci.tar")
        os.replace(work / "facts.json", facts_file(settings, key))
        os.replace(out, image_file(settings, key))
        fsync_dir(d)
        say(f"image {key[:12]} ready ({facts.init}, {content // 2**20} MiB in {size // 2**20} MiB, "
            f"{facts.build_seconds:.0f} s)")
        return facts



def _ca_file(settings: Settings) -> str | None:
    """The build CA bundle (:attr:`sbx.config.Settings.build_ca_file`), or None. Raises
    ``ImageError("image_build_failed")`` when it is set but no readable file."""
    path = settings.build_ca_file
    if not path:
        return None
    if not Path(path).is_file():
        raise ImageError("image_build_failed", f"SBX_BUILD_CA_FILE {path} is not a file")
    return path
