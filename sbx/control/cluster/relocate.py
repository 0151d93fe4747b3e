"""Moving a stopped sandbox to another node (issue 10, "resume on any node"): :func:`move_stopped`.

The control plane drives the steps of :mod:`sbx.node.migration.transfer` between two node agents: the destination's base
image digest, the source's export (disk delta with only the blocks the destination lacks, memory image, manifest
with SHA-256 of each file), each file streamed source -> this server -> destination in 1 MiB pieces (hash-checked
by the destination as it lands; the delta's own trailer is checked again when applied), then the destination's
commit. Until the commit nothing on the destination counts, and the source is untouched; the caller then points
the sandbox's ``node`` column at the destination (the commit point) and only after that deletes the source copy.
A server killed between the destination's commit and the commit point leaves a copy there that the store doesn't
point at: the next move to that node removes it first (the source's copy is the one the store names).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sbx.node.types import NodeError

log = logging.getLogger("sbx.control")

MIGRATE_WAIT = 600.0
"""Seconds a drain waits for a sandbox's operation in flight, its live migration or the hold for its move
(:mod:`sbx.control.cluster.drain`) before that sandbox fails with 409 busy."""


def clear_stale(dst: Any, sandbox_id: str) -> None:
    """Delete node agent ``dst``'s copy of ``sandbox_id`` before the sandbox comes there: it is stale, since the
    store puts the sandbox elsewhere (a move cut short after its commit, or an old copy whose delete failed).
    Raises ``NodeError``."""
    if dst.status(sandbox_id) != "absent":
        log.info("removing a stale copy of %s on the destination before the move", sandbox_id)
        dst.delete(sandbox_id)


def promote_replica(dst: Any, sandbox_id: str) -> dict[str, Any]:
    """Make the seal replica node agent ``dst`` holds the stopped sandbox ``sandbox_id`` there
    (:meth:`sbx.node.migration.replicas.ReplicaMixin.promote_replica`), after :func:`clear_stale`. Returns the shape of
    :func:`move_stopped`'s answer (``delta`` ``"replica"``, nothing moved over the network: ``seconds`` 0).
    Raises ``NodeError``."""
    clear_stale(dst, sandbox_id)
    return {"seconds": 0.0, "delta": "replica", **dst.promote_replica(sandbox_id)}


def move_stopped(src: Any, dst: Any, sandbox_id: str) -> dict[str, Any]:
    """Copy stopped sandbox ``sandbox_id`` from node agent ``src`` to ``dst`` (both with the transfer calls of
    :mod:`sbx.node.migration.transfer`: a :class:`sbx.node.agent.LocalNode` or
    :class:`sbx.node.remote.client.RemoteNode`).
    Returns ``{"bytes": moved, "files": n, "memory": bool, "delta": "incremental"|"full", "seconds": s}``.
    Raises ``NodeError`` (``node_unreachable``, ``transfer_corrupt``, ``transfer_failed``, ``invalid_state``...);
    then the destination has nothing and the source keeps the sandbox."""
    t0 = time.monotonic()
    clear_stale(dst, sandbox_id)
    manifest = src.export_stopped(sandbox_id, dst.transfer_parent())
    try:
        dst.begin_import(manifest)
        for name in manifest["files"]:
            dst.import_stream(sandbox_id, name, src.export_file(sandbox_id, name))
        dst.commit_import(sandbox_id)
    except BaseException:
        for undo in (lambda: dst.abort_import(sandbox_id), lambda: src.end_export(sandbox_id)):
            try:
                undo()
            except NodeError as e:
                log.warning("cleaning up the move of %s: %s", sandbox_id, e.message)
        raise
    moved = sum(int(f["size"]) for f in manifest["files"].values())
    return {"bytes": moved, "files": len(manifest["files"]), "memory": bool(manifest["memory"]),
            "delta": "incremental" if manifest.get("parent") else "full", "seconds": time.monotonic() - t0}
