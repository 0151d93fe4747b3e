"""Seals: the checkpoints of a sandbox disk, read-only reflink copies in a numbered chain per folder.

``<seal_dir>/<seq>.ext4`` (mode 0444) with its manifest ``<seq>.json``; ``seq`` counts up from 1 and is never
reused; each seal names its ``parent`` (the seal before it). A copy costs constant time and no space until the
disk is written again; :mod:`sbx.storage.delta` exports what changed between two seals.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sbx.storage.disk import PathLike, consistent_clone, remove_disk
from sbx.storage.errors import StorageError
from sbx.storage.locks import file_lock


@dataclass(frozen=True)
class Seal:
    """A sealed checkpoint of a disk: a read-only (0444) reflink copy at ``path`` = ``<seal_dir>/<seq>.ext4``
    with its manifest ``<seal_dir>/<seq>.json``. ``seq`` counts up from 1 per seal folder; ``parent`` is the
    seq of the seal before it in the chain (None for the first); ``created_at`` is ISO 8601 UTC;
    ``size_bytes`` is the image's length; ``source`` is the disk path it was sealed from. The filesystem UUID
    is the source's."""

    seq: int
    parent: int | None
    path: Path
    created_at: str
    size_bytes: int
    source: str

    @property
    def manifest_path(self) -> Path:
        return self.path.with_suffix(".json")

    def manifest(self) -> dict[str, Any]:
        """The JSON manifest's content: ``{"seq", "parent", "created_at", "size_bytes", "source",
        "image"}``."""
        d = asdict(self)
        d.pop("path")
        d["image"] = self.path.name
        return d


_SEQ_FILE = re.compile(r"^(\d+)\.(ext4|json)$")


def _write_manifest(s: Seal) -> None:
    tmp = s.manifest_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(s.manifest(), indent=1) + "\n")
    os.replace(tmp, s.manifest_path)


def _load(manifest: Path) -> Seal:
    d = json.loads(manifest.read_text())
    return Seal(
        seq=int(d["seq"]),
        parent=None if d.get("parent") is None else int(d["parent"]),
        path=manifest.parent / d.get("image", f"{d['seq']}.ext4"),
        created_at=str(d["created_at"]),
        size_bytes=int(d["size_bytes"]),
        source=str(d.get("source", "")),
    )


def seal(path: PathLike, seal_dir: PathLike, *, mountpoint: PathLike | None = None) -> Seal:
    """Seal the disk at ``path`` as the next checkpoint in ``seal_dir`` (created if missing) and return it.

    The seal is a reflink copy made read-only (chmod 0444): constant time whatever the disk's size, and no
    space until the disk is written again. A mounted disk (at ``mountpoint`` or found by
    :func:`sbx.storage.disk.mounted_at`)
    is frozen for the copy. Its parent is the newest seal already in ``seal_dir``. The image is written
    before the manifest, so a crash leaves at most an image without manifest, which :func:`list_seals`
    ignores.

    Raises ``StorageError``: ``not_found``, ``no_reflink``, ``not_mounted``.
    """
    src = Path(path)
    if not src.exists():
        raise StorageError("not_found", f"{src} does not exist")
    d = Path(seal_dir)
    d.mkdir(parents=True, exist_ok=True)
    with file_lock(d / ".lock"):
        existing = list_seals(d)
        used = [int(m.group(1)) for f in d.iterdir() if (m := _SEQ_FILE.match(f.name))]
        seq = max(used, default=0) + 1
        img = d / f"{seq}.ext4"
        consistent_clone(src, img, mountpoint, 0o444)
        s = Seal(
            seq=seq,
            parent=existing[-1].seq if existing else None,
            path=img,
            created_at=dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            size_bytes=img.stat().st_size,
            source=str(src),
        )
        _write_manifest(s)
    return s


def list_seals(seal_dir: PathLike) -> list[Seal]:
    """The seals in ``seal_dir`` (those with both image and manifest), oldest (lowest seq) first; empty when
    the folder does not exist."""
    d = Path(seal_dir)
    if not d.is_dir():
        return []
    out = []
    for f in d.glob("*.json"):
        if _SEQ_FILE.match(f.name):
            try:
                s = _load(f)
            except (OSError, ValueError, KeyError):
                continue
            if s.path.exists():
                out.append(s)
    return sorted(out, key=lambda s: s.seq)


def get_seal(seal_dir: PathLike, seq: int) -> Seal:
    """Seal number ``seq`` in ``seal_dir``. Raises ``StorageError("not_found")``."""
    for s in list_seals(seal_dir):
        if s.seq == seq:
            return s
    raise StorageError("not_found", f"no seal {seq} in {seal_dir}")


def delete_seal(seal_dir: PathLike, seq: int) -> None:
    """Delete seal ``seq`` (image and manifest); its children's ``parent`` becomes its own parent so the chain
    stays whole. Only blocks no other file shares are freed. Raises ``StorageError("not_found")``."""
    d = Path(seal_dir)
    with file_lock(d / ".lock"):
        gone = get_seal(d, seq)
        for s in list_seals(d):
            if s.parent == seq:
                _write_manifest(Seal(s.seq, gone.parent, s.path, s.created_at, s.size_bytes, s.source))
        remove_disk(gone.path)
        gone.manifest_path.unlink(missing_ok=True)
