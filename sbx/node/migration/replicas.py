"""Seal replicas: a stopped sandbox's disk and memory image kept on a second node (issue 10, "resume on any node
... or gone"): :class:`ReplicaMixin`.

A stopped sandbox's seal lives on its node's volume. So that the sandbox outlives that node, the control plane
(:mod:`sbx.control.cluster.replicas`) copies each seal to another node with the same steps as a move
(:mod:`sbx.node.migration.transfer`), but the copy is not made a sandbox there:

1. ``A.export_stopped(id, B.transfer_parent(), kind="replica")``: the disk delta and hard links to the memory
   image's files, apart from any move's export;
2. ``B.begin_replica(manifest)``, per file ``B.replica_stream(id, name, A.export_file(id, name, "replica"))``
   (hash-checked as it lands, as an import), ``B.seal_replica(id)``: the files go from
   ``replicas/<id>.part`` to ``replicas/<id>`` in one rename, so a replica is whole or absent;
3. ``A.end_export(id, "replica")``.

A replica is inert: no record in ``sandboxes/``, no container, no lease; the node's reconcile never looks at it.
When the sandbox's node is gone, ``B.promote_replica(id)`` makes it a stopped sandbox of B exactly as an import's commit
does (:meth:`sbx.node.migration.transfer.TransferMixin.commit_import`: delta applied onto B's base image, memory image
retargeted to B's uid range, a lease on B's bridge). Which replica is current is the control plane's to say (the store's
``seal_replicas`` row); ``B.replicas()`` lists what B holds so the control plane can drop the others
(``B.drop_replica(id)``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sbx.node.migration.transfer import TransferMixin, receive_file
from sbx.node.types import NodeError


class ReplicaMixin(TransferMixin):
    """Seal replicas kept for other nodes' stopped sandboxes (part of :class:`sbx.node.agent.LocalNode`)."""

    def _replica(self, sid: str, part: bool = False) -> Path:
        if not sid.startswith("sb_") or "/" in sid or sid in (".", ".."):
            raise NodeError("not_found", f"{sid!r} is not a sandbox id")
        return self.settings.node_dir / "replicas" / (sid + (".part" if part else ""))

    def begin_replica(self, manifest: dict[str, Any]) -> None:
        """Make room for a replica of the files of ``manifest`` (an ``export_stopped(..., kind="replica")``
        manifest), dropping an unfinished one. Raises ``NodeError``: ``exists`` (the sandbox itself is on this
        node), ``transfer_failed`` (the delta's parent is not this node's base image)."""
        sid = str(manifest["id"])
        if (self._dir(sid) / "node.json").exists():
            raise NodeError("exists", f"sandbox {sid} is on this node: it needs no replica here")
        self._check_parent(manifest)
        part = self._replica(sid, part=True)
        shutil.rmtree(part, ignore_errors=True)
        (part / "memory").mkdir(parents=True)
        (part / "manifest.json").write_text(json.dumps(manifest))

    def replica_stream(self, id: str, name: str, chunks: Iterable[bytes]) -> None:
        """Write file ``name`` of the replica of ``id`` being made from ``chunks`` (hash-checked). Raises
        ``NodeError``: ``not_found`` (no replica begun, or a name outside its manifest), ``transfer_corrupt``."""
        part = self._replica(id, part=True)
        try:
            want = json.loads((part / "manifest.json").read_text())["files"]
        except (OSError, ValueError):
            raise NodeError("not_found", f"no replica of {id} is being made") from None
        receive_file(part, want, name, chunks)

    def seal_replica(self, id: str) -> dict[str, Any]:
        """Make the replica of ``id`` being made the one this node holds (replacing an older one), once every
        file of its manifest is there. Returns ``{"bytes": total size, "memory": bool}``. Raises ``NodeError``:
        ``not_found``, ``transfer_corrupt`` (a file missing: the unfinished replica is dropped)."""
        part = self._replica(id, part=True)
        try:
            man = json.loads((part / "manifest.json").read_text())
        except (OSError, ValueError):
            raise NodeError("not_found", f"no replica of {id} is being made") from None
        missing = [n for n in man["files"] if not (part / n).is_file()]
        if missing:
            shutil.rmtree(part, ignore_errors=True)
            raise NodeError("transfer_corrupt", f"{missing[0]} was not received")
        final = self._replica(id)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(part, final)
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return {"bytes": sum(int(f["size"]) for f in man["files"].values()), "memory": bool(man["memory"])}

    def drop_replica(self, id: str) -> None:
        """Remove the replica of ``id`` and any unfinished one (nothing when there is none)."""
        shutil.rmtree(self._replica(id, part=True), ignore_errors=True)
        shutil.rmtree(self._replica(id), ignore_errors=True)

    def replicas(self) -> dict[str, dict[str, Any]]:
        """``{id: {"bytes", "memory", "from": the node it was copied from, "whole": bool}}`` of every replica
        here; ``whole`` false for one left unfinished (a copy cut by a crash: ``bytes`` 0), so the control plane
        drops those too."""
        folder = self.settings.node_dir / "replicas"
        out: dict[str, dict[str, Any]] = {}
        for d in sorted(folder.iterdir()) if folder.is_dir() else []:
            sid = d.name.removesuffix(".part")
            try:
                man = json.loads((d / "manifest.json").read_text())
            except (OSError, ValueError):
                man = {"files": {}, "memory": False}
            if d.name.endswith(".part"):
                out.setdefault(sid, {"bytes": 0, "memory": False, "from": man.get("from"), "whole": False})
            else:
                out[sid] = {"bytes": sum(int(f["size"]) for f in man["files"].values()),
                            "memory": bool(man["memory"]), "from": man.get("from"), "whole": True}
        return out

    def promote_replica(self, id: str) -> dict[str, Any]:
        """Make the replica of ``id`` a stopped sandbox of this node (``checkpointed`` when it has a memory
        image), as an import's commit does; the replica is used up. Returns ``{"bytes": its size, "files": how
        many, "memory": bool}``. Raises ``NodeError``: ``not_found`` (no whole replica), ``exists`` (the
        sandbox is already here), ``transfer_corrupt``/``transfer_failed`` (the replica's files don't make a
        sandbox; nothing is left of it then)."""
        final = self._replica(id)
        try:
            man = json.loads((final / "manifest.json").read_text())
        except (OSError, ValueError):
            raise NodeError("not_found", f"this node holds no replica of {id}") from None
        if (self._dir(id) / "node.json").exists():
            raise NodeError("exists", f"sandbox {id} is already on this node")
        try:
            self._commit_from(id, final)
        except NodeError as e:
            if e.code != "exists":
                self.drop_replica(id)
            raise
        return {"bytes": sum(int(f["size"]) for f in man["files"].values()), "files": len(man["files"]),
                "memory": bool(man["memory"])}
