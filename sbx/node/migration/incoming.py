"""Live migration, the destination's side: :class:`IncomingMixin` (the source's side and the order of the steps
are in :mod:`sbx.node.migration.outgoing`).

The destination keeps the incoming sandbox as an ordinary record in phase ``incoming``: its own network lease
(an address of this node's subnet), its own uid range, and the SHA-256 of a one-time ticket. The source sends the
files straight to this node's API with that ticket (``PUT /v1/node/migrate/<id>/<stage>``,
:mod:`sbx.node.remote.server`), then asks it to restore, then to go on:

- ``base``: the disk's pre-copy, a delta against the base image both nodes hold (or a full one);
- ``final``: the delta of the frozen disk against the pre-copy;
- ``memory``: the CRIU image (``runc checkpoint`` with the sandbox paused) and ``migration.json`` (the source's
  uid base);
- restore (:meth:`IncomingMixin.migrate_restore`): the disk is rebuilt from the two deltas, the image retargeted
  to this node's uid range (:func:`sbx.runtime.criuimages.retarget`), ``runc restore`` run with this node's
  bundle (the prestart hook wires the new address), and the restored container paused at once: until the source
  says go, the sandbox runs on one node only;
- go (:meth:`IncomingMixin.migrate_confirm`): unpaused, phase ``running``.

Crash safety: a record still ``incoming`` is never kept: :meth:`sbx.node.lifecycle.reconcile.ReconcileMixin.reconcile`
removes it with its container (the source keeps or resumes the sandbox), and :meth:`IncomingMixin.migrate_abort`
does the same on request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from sbx import tls
from sbx.config import Size
from sbx.node.agentbase import NodeBase
from sbx.node.container import cgroup
from sbx.node.migration.filestream import Unpacker
from sbx.node.types import NodeError, SandboxSpec
from sbx.runtime import criu, criuimages
from sbx.runtime.base import RuntimeError_
from sbx.runtime.pageserver import PageReceiver
from sbx.runtime.runc import remove_tree
from sbx.storage import delta, fiemap
from sbx.storage import disk as disks
from sbx.storage.errors import StorageError

log = logging.getLogger("sbx.node")

STAGES = ("base", "final", "memory")
INCOMING = "incoming"
PAGES_TIMEOUT = 300.0
"""Seconds the restore waits for the page server to have received the whole dump."""
TEST_HOLD_MIGRATION_ENV = "SBX_TEST_HOLD_MIGRATION"
"""Test-only: seconds the destination waits before its restore, with every file received and a marker
``<sandbox dir>/migrate-hold`` present, so a fault test can kill the destination agent halfway every time."""


def image_digest(path: Path) -> str:
    """SHA-256 over the length and the data extents (offset, bytes) of a sparse image: equal for byte-identical
    images, read in time proportional to the data, not the apparent size. Raises ``OSError``."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb", buffering=0) as f:
        for a, b in fiemap.merge((e.logical, min(e.end, size)) for e in fiemap.extents(path) if e.logical < size):
            h.update(f"{a}:{b}".encode())
            pos = a
            while pos < b:
                chunk = os.pread(f.fileno(), min(4 << 20, b - pos), pos)
                if not chunk:
                    break
                h.update(chunk)
                pos += len(chunk)
    return h.hexdigest()


class IncomingMixin(NodeBase):
    """The destination of a live migration (part of :class:`sbx.node.agent.LocalNode`)."""

    def base_image_digest(self) -> dict[str, str]:
        """``{"name": <base image file name>, "sha256": <image_digest>}`` of this node's base image, cached in
        ``<node_dir>/image-digest.json`` by name, length and mtime."""
        img = self.image
        st = img.stat()
        key = f"{img.name}:{st.st_size}:{st.st_mtime_ns}"
        cache = self.settings.node_dir / "image-digest.json"
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}
        if known.get("key") != key:
            known = {"key": key, "sha256": image_digest(img)}
            tmp = cache.with_suffix(".tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, cache)
        return {"name": img.name, "sha256": str(known["sha256"])}

    def migrate_prepare(self, spec: SandboxSpec, fingerprint: dict[str, str]) -> dict[str, Any]:
        """Make room for the sandbox ``spec`` arriving from another node whose host fingerprint is
        ``fingerprint`` (:func:`sbx.runtime.criu.host_fingerprint`). Returns ``{"ticket": <one-time token for
        the file and restore calls>, "image": {"name", "sha256"}}`` (this node's base image, which the source
        may send its disk as a delta against).

        An earlier arrival of the same id that was never confirmed is replaced: its move was abandoned (a server
        replica died between this call and the source's ``migrate_out``; a move in flight ends before the control
        plane starts another of the sandbox), as a restart of this agent would drop it.

        Raises ``NodeError``: ``exists`` (the id runs on this node), ``cpu_mismatch`` (a memory image of that host
        can't be restored here: the fields are named), and what a new record raises (``no_space``...)."""
        diff = criu.fingerprint_mismatch(fingerprint, criu.host_fingerprint(str(self.runtime.criu)))
        if diff:
            raise NodeError("cpu_mismatch", f"the source node differs from this one in {', '.join(diff)}: its "
                                            "memory can't be restored here")
        self.departed(spec.id)  # moving back here right after it left: its old copy goes first
        with self._lock(spec.id):
            if (self._dir(spec.id) / "node.json").is_file():
                if self._record(spec.id).get("phase") != INCOMING:
                    raise NodeError("exists", f"sandbox {spec.id} is already on this node")
                log.warning("%s: replacing an arrival that was never confirmed (its move was abandoned)", spec.id)
                self._stop_pages(spec.id)
                self.delete(spec.id)
            ticket = "sbxm_" + secrets.token_urlsafe(32)
            self._new_record(spec)
            self._set_phase(spec.id, INCOMING, ticketSha256=hashlib.sha256(ticket.encode()).hexdigest(),
                            incomingSince=time.time(), startedFrom="migration")
            incoming = self._dir(spec.id) / "incoming"
            remove_tree(incoming)
            for stage in STAGES:
                (incoming / stage).mkdir(mode=0o700, parents=True)
            return {"ticket": ticket, "image": self.base_image_digest()}

    def migrate_check_ticket(self, id: str, ticket: str) -> bool:
        """True when ``ticket`` is the one :meth:`migrate_prepare` gave for ``id`` (constant-time comparison of
        SHA-256 digests). It stays valid after the confirmation, for the source's idempotent confirm and state
        calls; every step that writes checks the phase itself."""
        try:
            rec = self._record(id)
        except NodeError:
            return False
        want = str(rec.get("ticketSha256", ""))
        got = hashlib.sha256(ticket.encode()).hexdigest()
        return bool(want) and secrets.compare_digest(want, got)

    def migrate_unpacker(self, id: str, stage: str) -> Unpacker:
        """An :class:`Unpacker` writing the files of ``stage`` (one of :data:`STAGES`) into their incoming
        folder, emptied first. Raises ``NodeError("bad_call")`` for another stage, ``not_found``."""
        if stage not in STAGES:
            raise NodeError("bad_call", f"unknown migration stage {stage!r}")
        if self._record(id).get("phase") != INCOMING:
            raise NodeError("not_incoming", f"sandbox {id} is not arriving on this node")
        folder = self._dir(id) / "incoming" / stage
        remove_tree(folder)
        folder.mkdir(mode=0o700, parents=True)
        # CRIU opens the image files as the restored tasks (the sandbox's shifted root): readable by all, inside
        # a folder only root and that group may enter (made so by migrate_restore)
        return Unpacker(folder, mode=0o644 if stage == "memory" else 0o600)

    def migrate_pages(self, id: str, address: str, peer: str) -> dict[str, Any]:
        """Receive the memory pages of the arrival ``id`` while the source dumps them: a page server
        (:class:`sbx.runtime.pageserver.PageReceiver`) on ``address`` (where the source reached this node) that
        takes one connection from ``peer`` (the source's address) and writes into ``incoming/pages``. Returns
        ``{"address", "port", "tls"}`` for the source's ``runc checkpoint --page-server`` (``tls``: the pages must
        come in TLS, :class:`sbx.runtime.pageserver.PageSender`). Raises ``NodeError``:
        ``not_incoming``, ``migration_failed`` (it can't listen)."""
        with self._lock(id):
            if self._record(id).get("phase") != INCOMING:
                raise NodeError("not_incoming", f"sandbox {id} is not arriving on this node")
            self._stop_pages(id)
            folder = self._dir(id) / "incoming" / "pages"
            remove_tree(folder)
            try:
                ident = tls.identity(self.settings.tls_dir)  # a node that serves TLS takes the pages in TLS
                rx = PageReceiver(self.runtime.criu, folder, self._dir(id) / "incoming" / "pages-work", address,
                                  peer, tls=ident.server_context() if ident is not None else None)
            except OSError as e:
                raise NodeError("migration_failed", f"page server on {address}: {e}") from e
            self._page_receivers[id] = rx
            return {"address": rx.address, "port": rx.port, "tls": rx.tls is not None}

    def _stop_pages(self, id: str) -> None:
        rx = self._page_receivers.pop(id, None)
        if rx is not None:
            rx.stop()

    def _take_pages(self, id: str, mem: Path) -> int:
        """When the pages came through a page server: wait for it to be done and move them into ``mem``, readable
        by the restored tasks as the streamed images are; their bytes (0 without a page server). Raises
        ``RuntimeError_``."""
        rx = self._page_receivers.pop(id, None)
        if rx is None:
            return 0
        try:
            rx.wait(PAGES_TIMEOUT)
        finally:
            rx.stop()
        total = 0
        for f in rx.folder.iterdir():
            if f.is_file():
                f.chmod(0o644)
                total += f.stat().st_size
                os.replace(f, mem / f.name)
        return total

    def migrate_restore(self, id: str) -> dict[str, float]:
        """Rebuild the disk from the received deltas, restore the received memory image and pause the restored
        container (see the module docstring). Returns ``{"diskS", "restoreS"}`` (seconds) and ``"pageBytes"``
        (what the page server received; 0 without one). Raises
        ``NodeError("restore_failed")`` with the container removed and the disk unmounted (the record stays
        ``incoming`` until :meth:`migrate_abort` or a reconcile removes it)."""
        with self._lock(id):
            rec = self._record(id)
            if rec.get("phase") != INCOMING:
                raise NodeError("not_incoming", f"sandbox {id} is not arriving on this node")
            incoming = self._dir(id) / "incoming"
            t0 = time.monotonic()
            try:
                self._rebuild_disk(id, incoming)
                meta = json.loads((incoming / "memory" / "migration.json").read_text())
            except (StorageError, OSError, ValueError, KeyError) as e:
                raise NodeError("restore_failed", f"rebuilding the disk: {e}") from e
            t1 = time.monotonic()
            mem = self._memory(id)
            remove_tree(mem)
            os.replace(incoming / "memory", mem)
            (mem / "migration.json").unlink()
            os.chown(mem, 0, self._uid_base(id))
            mem.chmod(0o750 if self._uid_base(id) else 0o700)
            disks.test_hold(TEST_HOLD_MIGRATION_ENV, self._dir(id) / "migrate-hold")
            size = self._size_of(rec)
            try:
                page_bytes = self._take_pages(id, mem)
                criuimages.retarget(mem, old_base=int(meta["uidBase"]), new_base=self._uid_base(id), hostname=None)
                criuimages.drop_time_namespace(mem)  # kept when the source ran in its own (a resumed one)
                self._mount(id)
                bundle = self._write_bundle(id, rec, size)
                self.runtime.restore(id, bundle, mem, self._dir(id) / "criu-work")
                self.runtime.pause(id)
            except (RuntimeError_, NodeError) as e:
                self._stop_pages(id)
                self._cleanup_container(id)
                self._umount(id)
                self._discard_memory(id)
                raise NodeError("restore_failed", e.detail if isinstance(e, RuntimeError_) else e.message) from e
            self._discard_memory(id)
            remove_tree(incoming)
            return {"diskS": t1 - t0, "restoreS": time.monotonic() - t1, "pageBytes": page_bytes}

    def _size_of(self, rec: dict[str, Any]) -> Size:
        try:
            return self.settings.size(rec["size"])
        except KeyError as e:
            raise NodeError("restore_failed", f"this node has no size {rec.get('size')!r}") from e

    def _rebuild_disk(self, id: str, incoming: Path) -> None:
        base = sorted((incoming / "base").glob("*.delta"))
        final = sorted((incoming / "final").glob("*.delta"))
        if len(base) != 1 or len(final) != 1:
            raise StorageError("bad_delta", "the disk's deltas did not all arrive")
        parent = self.image if delta.read_header(base[0]).get("parent") is not None else None
        pre = incoming / "pre.ext4"
        for p in (pre, self._disk(id)):
            p.unlink(missing_ok=True)
        delta.import_delta(parent, base[0], pre)
        delta.import_delta(pre, final[0], self._disk(id))
        pre.unlink()

    def migrate_confirm(self, id: str) -> None:
        """The source gave the sandbox up: unpause the restored container; phase ``running``. Idempotent (a
        second call on a running sandbox does nothing). Raises ``NodeError``: ``not_incoming``, ``migration_failed``
        (the container can't be thawed)."""
        with self._lock(id):
            rec = self._record(id)
            if rec.get("phase") == "running" and rec.get("startedFrom") == "migration":
                return
            if rec.get("phase") != INCOMING or self.runtime.state(id) != "paused":
                raise NodeError("not_incoming", f"sandbox {id} is not restored and waiting on this node")
            try:
                self.runtime.unpause(id)
            except RuntimeError_ as e:
                raise NodeError("migration_failed", e.detail) from e
            self._cpu_samples[id] = cgroup.cpu_mark(self._cgroup_path(id))
            self._set_phase(id, "running", systemState="running", migratedAt=time.time())

    def migrate_state(self, id: str) -> str:
        """Where an arrival stands: ``"absent"``, ``"incoming"`` (files or a paused restore, not confirmed) or
        ``"running"`` (confirmed)."""
        try:
            rec = self._record(id)
        except NodeError:
            return "absent"
        return "running" if rec.get("phase") == "running" else str(rec.get("phase"))

    def migrate_abort(self, id: str) -> bool:
        """Remove an arrival that was not confirmed (container, disk, files, lease, uid range). Returns True when
        there was one; a confirmed (running) sandbox is left alone (False)."""
        with self._lock(id):
            try:
                rec = self._record(id)
            except NodeError:
                return False
            self._stop_pages(id)
            if rec.get("phase") != INCOMING:
                return False
            log.warning("%s: removing an arrival that was not confirmed", id)
            self.delete(id)
            return True
