"""Who keeps an image file: one mark per node that recorded it, so a file several nodes share is deleted by the last.

Image files are named by content (:func:`sbx.node.images.store.image_key`), and every node on a host shares the data
volume's images folder: two servers (or two accounts' catalogs on two nodes) that build the same Dockerfile or import
the same archive get the same file. Each node that hands an image to its control plane marks it here
(``<images_dir>/.refs/<key>/<node name>``, an empty file); deleting the image removes that node's mark, and the file
goes only when no mark is left (:meth:`sbx.node.agent.LocalNode.delete_image`).
"""

from __future__ import annotations

import re
from pathlib import Path

from sbx.config import Settings

_KEY = re.compile(r"^[0-9a-f]{64}$")
_HOLDER = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def refs_dir(settings: Settings, key: str) -> Path:
    """``<images_dir>/.refs/<key>``. Raises ``ValueError`` for a key that is not 64 hex characters."""
    if not _KEY.match(key):
        raise ValueError(f"not an image key: {key!r}")
    return settings.images_dir / ".refs" / key


def add_ref(settings: Settings, key: str, holder: str) -> None:
    """Mark image ``key`` as kept by ``holder`` (a node name). Idempotent."""
    if not _HOLDER.match(holder):
        raise ValueError(f"not a holder name: {holder!r}")
    d = refs_dir(settings, key)
    d.mkdir(parents=True, exist_ok=True)
    (d / holder).touch()


def drop_ref(settings: Settings, key: str, holder: str) -> bool:
    """Remove ``holder``'s mark of image ``key``; True when no other holder keeps it (the file may go)."""
    d = refs_dir(settings, key)
    (d / holder).unlink(missing_ok=True)
    left = [p for p in d.iterdir()] if d.is_dir() else []
    if not left and d.is_dir():
        d.rmdir()
    return not left
