"""A stopped sandbox moving to another node (issue 10, "resume on any node"): :class:`TransferMixin`.

The control plane moves a stopped sandbox from node A to node B (:mod:`sbx.control.cluster.relocate`) in these steps,
each a node call (over the node API: :mod:`sbx.node.remote.server`):

1. ``B.transfer_parent()``: the base image B has and the SHA-256 of its content (:func:`image_digest`, cached);
2. ``A.export_stopped(id, parent)``: A writes its disk as a delta (:func:`sbx.storage.delta.export_delta`) against
   its own base image when that image has the same content digest as B's (only the blocks B lacks: what the
   sandbox changed), else a full delta; and lists every file that travels, with sizes and SHA-256: ``disk.delta``
   and the memory image's files (``memory/...``), plus the record's spec, size, disk generation and uid base;
3. ``B.begin_import(manifest)``, then per file ``B.import_stream(id, name, A.export_file(id, name))``: bytes stream
   node -> server -> node (1 MiB pieces, never a whole file in memory); B hashes what it writes and refuses a file
   whose SHA-256 differs (``transfer_corrupt``);
4. ``B.commit_import(id)``: the delta is applied onto B's base image (its own trailer hash checked again), the
   memory image is put in place and retargeted to B's uid range (:func:`sbx.runtime.criuimages.retarget`), and a
   record with a lease on B's bridge is written: the sandbox is now stopped on B, ``checkpointed`` when it has
   memory. Until this step B has only an ``incoming`` folder (a crash leaves nothing a reconcile keeps);
5. the control plane points the sandbox at B, then ``A.delete(id)`` and ``A.end_export(id)``.

Network: the sandbox's address comes from the node's bridge subnet. A memory image is dumped with ``--empty-ns
network`` and the prestart hook wires the new network namespace at restore, so on B it gets a fresh lease on B's
subnet (new address and gateway, same MAC: it is derived from the sandbox id): listening sockets on ``0.0.0.0``
answer at the new address; a socket bound to the old address would make the restore fail (then a cold boot with
``restore_failed``); open TCP connections are reset anyway. The hostname and ``/etc/hosts`` do not change.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from sbx.node.agentbase import NodeBase
from sbx.node.types import NodeError, SandboxSpec
from sbx.runtime import criu, criuimages
from sbx.runtime.base import RuntimeError_
from sbx.storage import delta
from sbx.storage.errors import StorageError

CHUNK = 1 << 20
"""Bytes per piece of a transferred file."""

EXPORT_KINDS = ("move", "replica", "archive", "snapshot")
"""What an export is for: a move (the sandbox leaves this node), a seal replica (a copy kept on another node), the seal
store (a stopped sandbox's seal), or the seal store's copy of a running sandbox's snapshot (its disk only)."""

SEEK_DATA, SEEK_HOLE = 3, 4


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while b := f.read(CHUNK):
            h.update(b)
    return h.hexdigest()


def image_digest(path: Path) -> str:
    """SHA-256 of the content of the sparse image ``path`` (every byte; holes hashed as the zeros they read as,
    without reading them), cached in ``<path>.sha256`` against its size and mtime. Raises ``OSError``."""
    st = path.stat()
    cache = path.with_name(path.name + ".sha256")
    stamp = f"{st.st_size} {st.st_mtime_ns}"
    try:
        got_stamp, digest = cache.read_text().rsplit(" ", 1)
        if got_stamp == stamp:
            return digest
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    zeros = bytes(CHUNK)
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = 0
        while pos < st.st_size:
            try:
                data = os.lseek(fd, pos, SEEK_DATA)
            except OSError:  # no data after pos
                data = st.st_size
            while pos < data:  # a hole: zeros
                n = min(CHUNK, data - pos)
                h.update(zeros[:n])
                pos += n
            if pos >= st.st_size:
                break
            hole = os.lseek(fd, pos, SEEK_HOLE)
            while pos < hole:
                b = os.pread(fd, min(CHUNK, hole - pos), pos)
                if not b:
                    break
                h.update(b)
                pos += len(b)
    finally:
        os.close(fd)
    digest = h.hexdigest()
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(f"{stamp} {digest}")
    os.replace(tmp, cache)
    return digest


def _safe_name(name: str, files: dict[str, Any]) -> str:
    if name not in files or name.startswith("/") or ".." in Path(name).parts:
        raise NodeError("not_found", f"{name!r} is not part of this transfer")
    return name


def receive_file(folder: Path, want: dict[str, Any], name: str, chunks: Iterable[bytes]) -> None:
    """Write file ``name`` (a name of the manifest's ``files``, ``want``) under ``folder`` from ``chunks``, hashing
    it, through a ``.part`` file renamed into place once its size and SHA-256 match the manifest's (synced
    first). Raises ``NodeError``: ``not_found`` (a name outside the manifest), ``transfer_corrupt`` (the file is
    removed)."""
    name = _safe_name(name, want)
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    h = hashlib.sha256()
    n = 0
    with part.open("wb") as f:
        for b in chunks:
            h.update(b)
            n += len(b)
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    if n != want[name]["size"] or h.hexdigest() != want[name]["sha256"]:
        part.unlink(missing_ok=True)
        raise NodeError("transfer_corrupt", f"{name}: got {n} bytes with SHA-256 {h.hexdigest()}, expected "
                                            f"{want[name]['size']} bytes with {want[name]['sha256']}")
    os.replace(part, path)


class TransferMixin(NodeBase):
    """Export a stopped sandbox and import one (part of :class:`sbx.node.agent.LocalNode`; module docstring)."""

    def _export_dir(self, sid: str, kind: str = "move") -> Path:
        """Where an export of ``sid`` is prepared: ``export`` for a move, ``export-replica`` for a seal replica
        (:mod:`sbx.node.migration.replicas`), ``export-archive`` for the seal store
        (:mod:`sbx.control.cluster.archive`), so they never share files. Raises ``NodeError("bad_call")`` for another
        ``kind``."""
        if kind not in EXPORT_KINDS:
            raise NodeError("bad_call", f"an export is for a move, a replica or the seal store, not {kind!r}")
        return self._dir(sid) / ("export" if kind == "move" else f"export-{kind}")

    def _incoming(self, sid: str) -> Path:
        return self.settings.node_dir / "incoming" / sid

    def transfer_parent(self) -> dict[str, str]:
        """``{"image": file name, "sha256": content digest}`` of this node's base image (the parent a disk delta
        is made against). Raises ``NodeError("transfer_failed")``."""
        try:
            return {"image": self.image.name, "sha256": image_digest(self.image)}
        except OSError as e:
            raise NodeError("transfer_failed", f"hashing the base image: {e}") from e

    def export_stopped(self, id: str, parent: dict[str, str] | None = None, kind: str = "move") -> dict[str, Any]:
        """Prepare the stopped sandbox ``id`` for a move (step 2 of the module docstring): the disk delta against this
        node's base image when ``parent`` (the destination's :meth:`transfer_parent`) has the same digest, else a full
        one. ``kind="replica"`` (or ``"archive"``, for the seal store): for a seal replica
        (:mod:`sbx.node.migration.replicas`): prepared apart from a move's
        export, and the memory image's files are hard-linked into it, so a resume that discards the image meanwhile, or
        a later dump, can't change what is sent. Returns the manifest: ``{"id", "spec", "size", "diskGen", "uidBase",
        "oomKills", "memory": bool, "freshIdentity": bool (a fork whose first start is still to come), "parent":
        {"image","sha256"} | None, "fingerprint": {...} | None, "files": {name: {"size", "sha256"}}}``. Raises
        ``NodeError``: ``not_found``, ``invalid_state`` (it runs), ``transfer_failed``."""
        with self._lock(id):
            rec = self._record(id)
            if self.runtime.state(id) is not None or rec["phase"] not in ("checkpointed", "stopped"):
                raise NodeError("invalid_state", f"sandbox {id} is not stopped ({rec['phase']})")
            out = self._export_dir(id, kind)
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            mine = self.transfer_parent()
            # a sandbox of a user image goes whole: the parent both sides share is the default image
            use_parent = (parent is not None and parent.get("sha256") == mine["sha256"]
                          and self._image_of(rec) is None)
            try:
                delta.export_delta(self._disk(id), self.image if use_parent else None, out / "disk.delta")
            except StorageError as e:
                shutil.rmtree(out, ignore_errors=True)
                raise NodeError("transfer_failed", f"exporting the disk: {e}") from e
            files = {"disk.delta": {"size": (out / "disk.delta").stat().st_size,
                                    "sha256": _sha256_file(out / "disk.delta")}}
            memory = rec["phase"] == "checkpointed" and self._memory_usable(id)
            if memory:
                mem = self._memory(id)
                for p in sorted(mem.rglob("*")):
                    if p.is_file():
                        if kind != "move":
                            (out / "memory" / p.relative_to(mem)).parent.mkdir(parents=True, exist_ok=True)
                            os.link(p, out / "memory" / p.relative_to(mem))
                        files[f"memory/{p.relative_to(mem)}"] = {"size": p.stat().st_size, "sha256": _sha256_file(p),
                                                                 "mode": p.stat().st_mode & 0o777}
            manifest = {
                "id": id, "spec": rec["spec"], "size": rec.get("size", rec["spec"].get("size")),
                "diskGen": int(rec.get("diskGen", 0)), "uidBase": int(rec.get("uidBase", 0)),
                "oomKills": int(rec.get("oomKills", 0)), "memory": memory,
                "freshIdentity": bool(rec.get("freshIdentity")),
                "parent": mine if use_parent else None,
                "fingerprint": criu.read_fingerprint(self._memory(id)) if memory else None,
                "files": files, "from": self.settings.node_name,
            }
            (out / "manifest.json").write_text(json.dumps(manifest))
            return manifest

    def export_snapshot(self, id: str, snapshot: str, parent: dict[str, str] | None = None) -> dict[str, Any]:
        """Prepare snapshot ``snapshot`` of sandbox ``id`` (running or not) for the seal store, as
        :meth:`export_stopped` does a stopped sandbox (export kind ``"snapshot"``): its disk as a delta against this
        node's base image when ``parent`` has the same digest, no memory. The snapshot's image is hard-linked into
        the export first, so pruning it meanwhile changes nothing. Returns the manifest of :meth:`export_stopped`
        (``memory`` false, ``fingerprint`` null) with ``"snapshot": snapshot``. Raises ``NodeError``: ``not_found``
        (no such sandbox or snapshot), ``invalid_snapshot_name``, ``transfer_failed``."""
        src = self._snapshot_path(snapshot)  # type: ignore[attr-defined]
        with self._lock(id):
            rec = self._record(id)
            out = self._export_dir(id, "snapshot")
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            try:
                os.link(src, out / "disk.ext4")
            except FileNotFoundError:
                shutil.rmtree(out, ignore_errors=True)
                raise NodeError("not_found", f"snapshot {snapshot!r} does not exist") from None
        mine = self.transfer_parent()
        use_parent = parent is not None and parent.get("sha256") == mine["sha256"] and self._image_of(rec) is None
        try:
            delta.export_delta(out / "disk.ext4", self.image if use_parent else None, out / "disk.delta")
        except StorageError as e:
            shutil.rmtree(out, ignore_errors=True)
            raise NodeError("transfer_failed", f"exporting snapshot {snapshot}: {e}") from e
        finally:
            (out / "disk.ext4").unlink(missing_ok=True)
        manifest = {
            "id": id, "spec": rec["spec"], "size": rec.get("size", rec["spec"].get("size")),
            "diskGen": int(rec.get("diskGen", 0)), "uidBase": int(rec.get("uidBase", 0)),
            "oomKills": int(rec.get("oomKills", 0)), "memory": False, "freshIdentity": False,
            "parent": mine if use_parent else None, "fingerprint": None, "snapshot": snapshot,
            "files": {"disk.delta": {"size": (out / "disk.delta").stat().st_size,
                                     "sha256": _sha256_file(out / "disk.delta")}},
            "from": self.settings.node_name,
        }
        (out / "manifest.json").write_text(json.dumps(manifest))
        return manifest

    def export_file(self, id: str, name: str, kind: str = "move") -> Iterator[bytes]:
        """The bytes of file ``name`` of the export of ``id`` for ``kind`` (a manifest name), in pieces of
        :data:`CHUNK`. Raises ``NodeError("not_found")``."""
        out = self._export_dir(id, kind)
        try:
            manifest = json.loads((out / "manifest.json").read_text())
        except (OSError, ValueError):
            raise NodeError("not_found", f"sandbox {id} has no export in progress") from None
        name = _safe_name(name, manifest["files"])
        path = out / name if name == "disk.delta" or kind != "move" else self._memory(id) / name[len("memory/"):]
        try:
            f = path.open("rb")
        except OSError as e:
            raise NodeError("not_found", f"{name}: {e}") from e

        def pieces() -> Iterator[bytes]:
            with f:
                while b := f.read(CHUNK):
                    yield b

        return pieces()

    def end_export(self, id: str, kind: str = "move") -> None:
        """Remove what :meth:`export_stopped` prepared for ``kind`` (nothing when there is none)."""
        shutil.rmtree(self._export_dir(id, kind), ignore_errors=True)

    def begin_import(self, manifest: dict[str, Any]) -> None:
        """Make room for the files of ``manifest`` (step 3). Raises ``NodeError("exists")`` when the sandbox is
        already on this node, ``transfer_failed`` when the delta's parent is not this node's base image."""
        sid = str(manifest["id"])
        if (self._dir(sid) / "node.json").exists():
            raise NodeError("exists", f"sandbox {sid} is already on this node")
        self._check_parent(manifest)
        inc = self._incoming(sid)
        shutil.rmtree(inc, ignore_errors=True)
        (inc / "memory").mkdir(parents=True)
        (inc / "manifest.json").write_text(json.dumps(manifest))

    def _manifest_in(self, sid: str) -> dict[str, Any]:
        try:
            return json.loads((self._incoming(sid) / "manifest.json").read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            raise NodeError("not_found", f"no import of {sid} in progress") from None

    def import_stream(self, id: str, name: str, chunks: Iterable[bytes]) -> None:
        """Write file ``name`` of the import of ``id`` from ``chunks``, hashing it; a file whose size or
        SHA-256 differs from the manifest's is removed and ``NodeError("transfer_corrupt")`` raised."""
        receive_file(self._incoming(id), self._manifest_in(id)["files"], name, chunks)

    def abort_import(self, id: str) -> None:
        """Drop an unfinished import of ``id`` (nothing when there is none)."""
        shutil.rmtree(self._incoming(id), ignore_errors=True)

    def _check_parent(self, manifest: dict[str, Any]) -> None:
        parent = manifest.get("parent")
        if parent is not None and parent.get("sha256") != self.transfer_parent()["sha256"]:
            raise NodeError("transfer_failed", "the disk delta was made against another base image")

    def commit_import(self, id: str) -> None:
        """Make the imported sandbox ``id`` a stopped sandbox of this node (step 4 of the module docstring).
        Raises ``NodeError``: ``not_found``, ``transfer_corrupt`` (a file missing or the delta's hash wrong),
        ``transfer_failed``; the partial sandbox is removed then."""
        self._commit_from(id, self._incoming(id))

    def _commit_from(self, id: str, inc: Path) -> None:
        """:meth:`commit_import` from the files in ``inc`` (an import, or a seal replica being promoted)."""
        try:
            man = json.loads((inc / "manifest.json").read_text())
        except (OSError, ValueError):
            raise NodeError("not_found", f"no import of {id} in progress") from None
        for name in man["files"]:
            if not (inc / name).is_file():
                raise NodeError("transfer_corrupt", f"{name} was not received")
        with self._lock(id):
            if (self._dir(id) / "node.json").exists():
                raise NodeError("exists", f"sandbox {id} is already on this node")
            spec = man["spec"]
            size = self.settings.size(str(man["size"]))
            fresh = {"freshIdentity": True} if man.get("freshIdentity") else {}  # a fork made to move
            self._new_record(SandboxSpec(id=id, hostname=spec["hostname"], size=size, env=dict(spec.get("env", {})),
                                         image=spec.get("image"), runtime=spec.get("runtime") or "container"),
                             movedFrom=man.get("from"), **fresh)
            try:
                parent = self.image if man.get("parent") else None
                try:
                    delta.import_delta(parent, inc / "disk.delta", self._disk(id))
                except StorageError as e:
                    raise NodeError("transfer_corrupt" if e.code == "bad_delta" else "transfer_failed",
                                    f"importing the disk: {e}") from e
                base = self._uid_base(id)
                if man["memory"]:
                    mem = self._memory(id)
                    shutil.rmtree(mem, ignore_errors=True)
                    os.replace(inc / "memory", mem)
                    for name, meta in man["files"].items():
                        if name.startswith("memory/") and "mode" in meta:
                            (mem / name[len("memory/"):]).chmod(int(meta["mode"]))
                    os.chown(mem, 0, base)
                    mem.chmod(0o750 if base else 0o700)
                    try:  # (a gvisor sandbox's runsc image holds no host uid: nothing to retarget)
                        if (spec.get("runtime") or "container") == "container":
                            criuimages.retarget(mem, old_base=int(man["uidBase"]), new_base=base, hostname=None)
                    except RuntimeError_ as e:
                        raise NodeError("transfer_failed", f"retargeting the memory image: {e.detail}") from e
                self._set_phase(id, "checkpointed" if man["memory"] else "stopped", diskGen=int(man["diskGen"]),
                                size=size.name, oomKills=int(man.get("oomKills", 0)))
                self._seal(id)
            except BaseException:
                shutil.rmtree(self._dir(id), ignore_errors=True)
                raise
        shutil.rmtree(inc, ignore_errors=True)
