"""A build's claim on host resources: a host uid range (RUN steps and the sbx layer run shifted into it, never as
host root) and, for a node's build, a network lease on its bridge.

A claim is a record ``<volume>/nodes/<node>/builds/<id>.json`` (``{"uidBase": B, "pid": P, "lease": {...}}``) written
under the host-wide uid-range lock (:func:`sbx.node.container.rootfs.uid_range`), whose scan
(:func:`sbx.node.container.rootfs.taken_uid_bases`) counts build records beside sandbox records, and which
:meth:`sbx.node.agentbase.NodeBase._new_lease` reads for the addresses builds hold. The record goes when the claim
ends; one whose process is gone (a killed build) is removed at the next claim.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sbx.config import Settings
from sbx.node.container import rootfs
from sbx.node.images.errors import ImageError
from sbx.storage.errors import StorageError


@dataclass(frozen=True)
class Claim:
    """A build's reservation: ``build_id`` (12 hex chars), ``uid_base`` (first host uid of its 65536), ``lease``
    (the address record ``{"address", "gateway", "host_veth"}`` or ``None``)."""

    build_id: str
    uid_base: int
    lease: dict[str, str] | None


def builds_dir(settings: Settings) -> Path:
    """The folder of this node's build records: ``<volume>/nodes/<node>/builds``."""
    return settings.node_dir / "builds"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drop_stale(settings: Settings) -> list[str]:
    """Remove the build records of every node on the host whose process is gone; returns their ids."""
    gone = []
    for p in (settings.volume / "nodes").glob("*/builds/*.json"):
        try:
            pid = int(json.loads(p.read_text()).get("pid", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            pid = 0
        if not pid or not _alive(pid):
            p.unlink(missing_ok=True)
            gone.append(p.stem)
    return gone


@contextmanager
def claim(settings: Settings, lease_for: Callable[[str], dict[str, str]] | None = None) -> Iterator[Claim]:
    """Reserve a uid range (and, given ``lease_for`` (build id -> lease record, e.g. the node's ``_new_lease``,
    called under the uid-range lock), an address) for the ``with`` block. Raises
    ``ImageError("image_build_failed")`` when every range is taken."""
    build_id = secrets.token_hex(6)
    folder = builds_dir(settings)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{build_id}.json"
    try:
        with rootfs.uid_range(settings.home, settings.volume) as base:
            drop_stale(settings)
            lease = lease_for(f"build-{build_id}") if lease_for else None
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"uidBase": base, "pid": os.getpid(), "lease": lease}))
            os.replace(tmp, path)
    except StorageError as e:
        raise ImageError("image_build_failed", f"no host uid range for the build: {e}") from e
    # drop_stale ran under the lock with a fresh scan, so the base it yielded was free of stale claims too
    try:
        yield Claim(build_id, base, lease)
    finally:
        path.unlink(missing_ok=True)
